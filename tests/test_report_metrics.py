"""`spml-cache report --metric`, `--ci` and `--compare a,b` over run directories written by the stages' own writers
(`runs.write_scores` with every seed's test scores, `runs.write_labels`); the expected numbers are restated here
with scikit-learn on the stored scores, the resamples written out image by image."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_support import one_error_line, run_cli
from rich.console import Console
from sklearn.metrics import (
    average_precision_score, label_ranking_average_precision_score, precision_recall_curve,
    precision_recall_fscore_support,
)

from spml_cache import report, runs
from spml_cache.labels import SparseLabels
from spml_cache.report import measures

CLASSES = ["cat", "dog", "car", "bus", "sky"]


def fake_scores(seed: int, labels: np.ndarray, signal: float, seeds: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = signal * (2 * labels.astype(np.float32) - 1) + rng.normal(scale=1.5, size=(seeds, *labels.shape))
    return (1 / (1 + np.exp(-logits))).astype(np.float32)


def sklearn_map(scores, labels):
    return 100 * np.mean([average_precision_score(labels[:, c], scores[:, c]) if labels[:, c].any() else 0.0
                          for c in range(labels.shape[1])])


def restated_map11(scores, labels):
    """VOC 2007's 11-point mAP as DINOv3's map_voc2007 takes it from a precision-recall curve: per class, the mean
    over r = 0, 0.1, ..., 1 of the highest precision on the curve (its point (recall 0, precision 1) included) at a
    recall of r or more; a class without a positive counting 0."""
    aps = []
    for c in range(labels.shape[1]):
        if not labels[:, c].any():
            aps.append(0.0)
            continue
        precision, recall, _ = precision_recall_curve(labels[:, c], scores[:, c])
        aps.append(np.mean([precision[recall * 10 >= level - 1e-9].max() for level in range(11)]))
    return 100 * float(np.mean(aps))


def sklearn_cf1(scores, labels, top_k=None):
    if top_k is None:
        chosen = scores >= 0.5
    else:
        chosen = np.zeros(scores.shape, dtype=bool)
        for row, values in enumerate(scores):  # ML-GCN's top k: of the k highest, those scoring at least 0.5
            chosen[row, [c for c in sorted(range(len(values)), key=lambda c: (-values[c], c))[:top_k]
                         if values[c] >= 0.5]] = True
    precision, recall, _, _ = precision_recall_fscore_support(labels, chosen, average=None, zero_division=0)
    cp, cr = precision.mean(), recall.mean()
    return 100 * 2 * cp * cr / (cp + cr)


def write_run(root: Path, scores: dict[str, np.ndarray], labels, *, stamp="20240101-000000", mask=None,
              old=False) -> Path:
    """A linear run of the losses in `scores` ({loss: [seeds, N, C]}), its files as stage two writes them; `old`:
    as a run written before the per-seed test scores were kept (no test_seeds, no test_labels.npz)."""
    run = root / "voc" / f"linear-all-{stamp}"
    run.mkdir(parents=True)
    seeds = len(next(iter(scores.values())))
    runs.write_json(run / "config.json", {"stage": "linear", "dataset": "voc", "cache_id": "cafe0001",
                                          "classes": CLASSES, "losses": list(scores), "seeds": list(range(seeds))})
    dense = labels.to_dense(np.uint8) if isinstance(labels, SparseLabels) else labels
    runs.write_labels(run, train_labels=labels, train_observed=labels, val_labels=labels, test_labels=labels,
                      test_mask=mask)
    entries = {}
    for loss, per_seed in scores.items():
        kept = None if old else runs.SeedScores(list(range(seeds)), torch.from_numpy(per_seed), labels, mask)
        runs.write_scores(run, loss, kept, test=torch.from_numpy(per_seed[0]))
        maps = [sklearn_map(s, dense) for s in per_seed]
        entries[loss] = {"selected": {"lr": 1e-3, "batch_size": 8, "hparams": {}}, "test_map": float(np.mean(maps)),
                         "test_map_std": float(np.std(maps)),
                         "per_seed": [{"seed": s, "test_map": m} for s, m in enumerate(maps)]}
    if old:
        (run / runs.TEST_LABELS).unlink()
    runs.write_json(run / runs.RESULTS, {"stage": "linear", "dataset": "voc", "cache_id": "cafe0001",
                                         "complete": True, "losses": entries})
    return run


@pytest.fixture
def world(tmp_path):
    rng = np.random.default_rng(0)
    labels = (rng.random((60, 5)) < 0.3).astype(np.uint8)
    scores = {"an": fake_scores(1, labels, 1.0), "role": fake_scores(2, labels, 1.6)}
    scores["an_ls"] = scores["an"].copy()  # the same scores as an: a difference of exactly 0
    write_run(tmp_path / "runs", scores, labels)
    return tmp_path, labels, scores


def in_process(root, **flags) -> tuple[report.tables.Table, str]:
    """`report_command` as the CLI calls it, with the table it built: (table, what it printed)."""
    console = Console(file=io.StringIO(), width=400)
    built = {}
    original = report.command._measured

    def keep(*args, **kwargs):
        built["table"] = original(*args, **kwargs)
        return built["table"]

    report.command._measured = keep
    try:
        report.report_command(report.ReportOptions([root], **flags), console)
    finally:
        report.command._measured = original
    return built["table"], console.file.getvalue()


@pytest.mark.parametrize("fmt", ["json", "csv", "md"])
def test_file_formats_carry_every_metric(world, fmt):
    tmp_path, labels, scores = world
    if fmt == "json":  # as a user types it; the others through the same door in this process
        done = run_cli("report", "--metric", "cf1@2", "--format", fmt, "--out", f"t.{fmt}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    else:
        in_process(tmp_path / "runs", metric="cf1@2", fmt=fmt, output=tmp_path / f"t.{fmt}")
    text = (tmp_path / f"t.{fmt}").read_text()
    names = measures.every_metric(2)
    assert names == ["map", "map11", "lrap", "cp", "cr", "cf1", "op", "or", "of1", "cp@2", "cr@2", "cf1@2", "op@2",
                     "or@2", "of1@2"]
    expected = {"map": np.mean([sklearn_map(s, labels) for s in scores["role"]]),
                "map11": np.mean([restated_map11(s, labels) for s in scores["role"]]),
                "lrap": np.mean([100 * label_ranking_average_precision_score(labels, s) for s in scores["role"]]),
                "cf1": np.mean([sklearn_cf1(s, labels) for s in scores["role"]]),
                "cf1@2": np.mean([sklearn_cf1(s, labels, 2) for s in scores["role"]])}
    if fmt == "json":
        payload = json.loads(text)
        assert payload["metric_name"] == "cf1@2" and payload["every_metric"] == names
        cell = {row["loss"]: row for row in payload["rows"]}["role"]["cells"]["VOC linear"]
        assert set(cell["metrics"]) == set(names)
        for name, value in expected.items():
            assert cell["metrics"][name][0] == pytest.approx(value, abs=1e-6), name
        assert cell["mean"] == pytest.approx(expected["cf1@2"], abs=1e-6)  # the table's metric
    elif fmt == "csv":
        row = {r["loss"]: r for r in csv.DictReader(io.StringIO(text))}["role"]
        for name in names:
            assert f"VOC linear {name}" in row and f"VOC linear {name} std" in row
        for name, value in expected.items():
            assert float(row[f"VOC linear {name}"]) == pytest.approx(value, abs=1e-6), name
    else:
        header = ("| loss | mAP | mAP (VOC07 11-point) | LRAP | CP | CR | CF1 | OP | OR | OF1 | CP (top 2) | CR (top 2)"
                  " | CF1 (top 2) | OP (top 2) | OR (top 2) | OF1 (top 2) |")
        (row,) = [line for line in text.splitlines()[text.splitlines().index(header):] if line.startswith("| ROLE |")]
        cells = [cell.strip() for cell in row.split("|")[2:-1]]  # | role | mAP | mAP (11-point) | LRAP | CP | CR | CF1
        for name, at in (("map11", 1), ("lrap", 2), ("cf1", 5)):
            assert cells[at].startswith(f"{expected[name]:.2f} ± "), name


def test_ci_restated_from_the_resamples_written_out(world):
    tmp_path, labels, scores = world
    table, printed = in_process(tmp_path / "runs", ci=True, resamples=100)
    cell = {loss: cells["VOC linear"] for loss, cells in table.rows}["role"]
    drawn = np.random.default_rng(0).integers(0, 60, size=(100, 60))  # resample b: rng.integers(0, N, N), seed 0
    resampled = [np.mean([sklearn_map(s[rows], labels[rows]) for s in scores["role"]]) for rows in drawn]
    assert cell.interval == pytest.approx(list(np.quantile(resampled, [0.025, 0.975])), abs=1e-9)
    assert cell.interval[0] < cell.mean < cell.interval[1]
    assert f"{cell.mean:.2f} ± {cell.std:.2f} [{cell.interval[0]:.2f}, {cell.interval[1]:.2f}]" in printed
    assert "[95% bootstrap interval over the test images, 100 resamples]" in printed
    assert "± is the seeds' spread" in printed and "[low, high] the test set's" in printed


def test_metric_ci_and_compare_from_a_subprocess(world):
    tmp_path, labels, scores = world
    done = run_cli("report", "--metric", "cf1", "--ci", "--resamples", "300", "--compare", "an,role", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert ("Test CF1 at the selected epoch (mean ± std over seeds; [95% bootstrap interval over the test images, 300"
            " resamples])") in done.stdout
    cf1 = {loss: [sklearn_cf1(s, labels) for s in scores[loss]] for loss in scores}
    for loss in ("an", "role"):
        assert f"{np.mean(cf1[loss]):.2f} ± {np.std(cf1[loss]):.2f} [" in done.stdout, loss
    best = max(("an", "role"), key=lambda loss: np.mean(cf1[loss]))
    assert f"{np.mean(cf1[best]):.2f} ± {np.std(cf1[best]):.2f} [" in done.stdout.split(" *")[0][-60:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("VOC linear: an - role = ")]
    difference = np.mean(cf1["an"]) - np.mean(cf1["role"])
    assert line.startswith(f"VOC linear: an - role = {difference:+.2f} CF1, 95% interval over the test images [")
    assert "(paired bootstrap, 300 resamples), p = " in line and "over seeds: an " in line and "(2 seeds)" in line
    _, same = in_process(tmp_path / "runs", compare="an_ls,an")
    (line,) = [line for line in same.splitlines() if line.startswith("VOC linear: an_ls - an")]
    assert "= +0.00 mAP" in line and "[+0.00, +0.00]" in line and "p = 1;" in line
    assert line.endswith("the interval contains 0: the test set's noise can explain the difference")


@pytest.mark.parametrize("metric", ["map11", "lrap"])
def test_the_other_rankings_and_their_intervals_restated_from_the_resamples_written_out(world, metric):
    tmp_path, labels, scores = world
    restated = {"map11": restated_map11,
                "lrap": lambda s, y: 100 * label_ranking_average_precision_score(y, s)}[metric]
    table, printed = in_process(tmp_path / "runs", metric=metric, ci=True, resamples=100)
    cell = {loss: cells["VOC linear"] for loss, cells in table.rows}["role"]
    values = [restated(s, labels) for s in scores["role"]]
    assert (cell.mean, cell.std) == (pytest.approx(np.mean(values), abs=1e-9), pytest.approx(np.std(values), abs=1e-9))
    drawn = np.random.default_rng(0).integers(0, 60, size=(100, 60))
    resampled = [np.mean([restated(s[rows], labels[rows]) for s in scores["role"]]) for rows in drawn]
    assert cell.interval == pytest.approx(list(np.quantile(resampled, [0.025, 0.975])), abs=1e-9)
    title = {"map11": "mAP (VOC07 11-point)", "lrap": "LRAP"}[metric]
    assert f"Test {title} at the selected epoch (mean ± std over seeds; [95% bootstrap" in printed


def test_lrap_compared_from_a_subprocess(world):
    tmp_path, labels, scores = world
    done = run_cli("report", "--metric", "lrap", "--compare", "role,an", "--resamples", "200", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lrap = {loss: [100 * label_ranking_average_precision_score(labels, s) for s in scores[loss]] for loss in scores}
    difference = np.mean(lrap["role"]) - np.mean(lrap["an"])
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("VOC linear: role - an = ")]
    assert line.startswith(f"VOC linear: role - an = {difference:+.2f} LRAP, 95% interval over the test images [")


def test_compare_is_paired_and_restated(world):
    tmp_path, labels, scores = world
    table, _ = in_process(tmp_path / "runs", compare="role,an", resamples=100)
    (found,) = table.comparisons
    drawn = np.random.default_rng(0).integers(0, 60, size=(100, 60))
    differences = np.array([np.mean([sklearn_map(s[rows], labels[rows]) for s in scores["role"]])
                            - np.mean([sklearn_map(s[rows], labels[rows]) for s in scores["an"]]) for rows in drawn])
    assert (found.low, found.high) == pytest.approx(tuple(np.quantile(differences, [0.025, 0.975])), abs=1e-9)
    smaller = min((differences <= 0).sum(), (differences >= 0).sum())
    assert found.p_value == pytest.approx(min(1.0, 2 * (smaller + 1) / 101))


def test_sparse_and_masked_test_labels_are_read_back_as_stored(tmp_path):
    rng = np.random.default_rng(3)
    labels = (rng.random((50, 5)) < 0.3).astype(np.uint8)
    mask = (rng.random((50, 5)) < 0.7).astype(np.uint8)
    mask[0] = 1
    scores = {"an": fake_scores(4, labels, 1.2), "role": fake_scores(5, labels, 1.5)}
    write_run(tmp_path / "dense", scores, labels, mask=mask)
    write_run(tmp_path / "sparse", scores, SparseLabels.from_dense(labels), mask=SparseLabels.from_dense(mask))
    with np.load(next((tmp_path / "sparse").rglob(runs.TEST_LABELS))) as stored:
        assert "labels_csr_indptr" in stored and "mask_csr_indptr" in stored and "labels" not in stored
    tables = [in_process(tmp_path / name, metric="of1@3", ci=True, resamples=100)[0] for name in ("dense", "sparse")]
    cells = [{loss: cells["VOC linear"] for loss, cells in table.rows} for table in tables]
    for loss in scores:
        assert cells[0][loss].metrics == cells[1][loss].metrics and cells[0][loss].interval == cells[1][loss].interval
    entries = mask != 0  # OF1 for the top 3: over the annotated entries only
    chosen = measures.metrics.predicted(torch.from_numpy(scores["an"][0]), 3).numpy()
    _, _, of1, _ = precision_recall_fscore_support(labels[entries], chosen[entries], average="binary")
    per_seed = measures.seed_values(runs.read_stored_test(next((tmp_path / "dense").rglob("linear-*")), "an"))
    assert per_seed["of1@3"][0] == pytest.approx(100 * of1, abs=1e-9)


def test_old_runs_report_map_and_name_what_is_unavailable(tmp_path):
    rng = np.random.default_rng(6)
    labels = (rng.random((40, 5)) < 0.3).astype(np.uint8)
    old = write_run(tmp_path / "runs", {"an": fake_scores(7, labels, 1.0), "role": fake_scores(8, labels, 1.4)},
                    labels, old=True)
    table, printed = in_process(tmp_path / "runs", ci=True, compare="an,role")
    role = {loss: cells["VOC linear"] for loss, cells in table.rows}["role"]
    assert role.mean is not None and role.interval is None  # mAP from results.json, as always
    assert f"n/a: {old} kept no per-seed test scores" in printed
    assert "VOC linear: an - role: not compared (a run kept no per-seed test scores; run it again)" in printed
    table, printed = in_process(tmp_path / "runs", metric="cf1")
    assert {cells["VOC linear"].mean for _, cells in table.rows} == {None} and "n/a" in printed


@pytest.mark.parametrize("args,expected", [
    (["--metric", "f2"], "error: --metric f2: use map, map11, lrap, cp, cr, cf1, op, or, of1, or one of cp, cr, cf1,"
                         " op, or, of1 with @K"),
    (["--metric", "map11@3"], "error: --metric map11@3: use map"),
    (["--metric", "cf1@0"], "error: --metric cf1@0: use map"),
    (["--resamples", "50"], "error: --resamples 50: a 95% interval needs at least 100 resamples"),
    (["--paper", "--metric", "cf1"], "error: --paper: the papers publish mAP only"),
    (["--compare", "an,em"], "error: --compare an,em: no column of the table has both"),
])
def test_bad_flags_are_one_line(world, args, expected, monkeypatch, capsys):
    tmp_path, _, _ = world
    line = one_error_line(["report", *args], subprocess_too=args[0] == "--metric" and args[1] == "f2", cwd=tmp_path,
                          monkeypatch=monkeypatch, capsys=capsys)
    assert line.startswith(expected), line


def test_stage_two_keeps_every_seed_s_test_scores_and_per_class_f1(tmp_path):
    from linear_support import quiet, write_synthetic_cache

    from spml_cache.linear import run_linear

    path = write_synthetic_cache(tmp_path / "voc.h5")
    done = run_linear(cache=path, out=tmp_path / "runs", console=quiet(), losses=["an"], lrs=[1e-2],
                      batch_sizes=[8], epochs=2, seeds=2)
    run_dir = Path(done.run_dir)
    kept = runs.read_stored_test(run_dir, "an")
    from spml_cache import cache

    test_labels = cache.load(path).test.labels
    np.testing.assert_array_equal(kept.labels, test_labels)
    assert kept.seeds == [0, 1] and kept.scores.shape == (2, *test_labels.shape) and kept.mask is None
    per_seed = done.results["losses"]["an"]["per_seed"]
    for seed, scores in enumerate(kept.scores):  # the very scores the stage's own test mAP was taken on
        assert sklearn_map(scores, test_labels) == pytest.approx(per_seed[seed]["test_map"], abs=1e-6)
    with np.load(run_dir / "scores" / "an.npz") as stored:
        for name, top_k in (("per_class_f1", None), ("per_class_f1@3", 3)):
            for seed, scores in enumerate(kept.scores):
                chosen = measures.metrics.predicted(torch.from_numpy(scores), top_k).numpy()
                _, _, f1, _ = precision_recall_fscore_support(test_labels, chosen, average=None, zero_division=0)
                np.testing.assert_allclose(stored[name][seed], f1, atol=1e-12)
