"""`spml-cache report`: tables and figures from hand-made run directories in the on-disk format of
docs/internals.md ("run directories"). Expected numbers are restated here, not computed by report.py."""

from __future__ import annotations

import csv
import io
import json
import re
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_support import run_cli, run_main
from matplotlib.colors import to_hex
from rich.console import Console
from sklearn.metrics import average_precision_score

from spml_cache import losses, report
from spml_cache.report import collect, plots, val_curves
from spml_cache.runtime.errors import SpmlError

CLASSES = ["cat", "dog", "car", "bus", "sky"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_run(root, dataset, stage, test_maps, *, stamp, cache_id="cafe0001", complete=True, train_map=True,
             init=None, weights="IMAGENET1K_V1"):
    """One run directory; `test_maps` = {loss: [test mAP per seed]} (the selected config of each loss)."""
    run = Path(root) / dataset / f"{stage}-{'all' if len(test_maps) > 1 else next(iter(test_maps))}-{stamp}"
    (run / "scores").mkdir(parents=True)
    rng = np.random.default_rng(len(str(run)))
    num_seeds = len(next(iter(test_maps.values())))
    config = {"stage": stage, "dataset": dataset, "cache": f"cache/{dataset}.h5", "cache_id": cache_id,
              "cache_attrs": {"dataset": dataset, "weights": weights},
              "classes": CLASSES, "losses": list(test_maps), "lrs": [1e-3, 1e-4], "batch_sizes": [8, 16],
              "epochs": 4, "seeds": list(range(num_seeds)), **({"init": {"mode": init}} if init else {})}
    (run / "config.json").write_text(json.dumps(config))
    num_train, num_classes = 40, len(CLASSES)
    labels = (rng.random((num_train, num_classes)) < 0.4).astype(np.uint8)
    labels[np.arange(num_train), rng.integers(0, num_classes, num_train)] = 1
    observed = np.zeros_like(labels, dtype=np.int8)
    for row in range(num_train):
        observed[row, rng.choice(np.flatnonzero(labels[row]))] = 1
    np.savez(run / "labels.npz", train_labels=labels, train_observed=observed,
             val_labels=labels[:10], test_labels=labels[:10])
    metrics, results = [], {}
    for index, (loss, per_seed) in enumerate(test_maps.items()):
        for lr, batch_size in [(1e-3, 8), (1e-4, 16)]:
            for seed in range(num_seeds):
                for epoch in range(1, 5):
                    metrics.append({"loss": loss, "lr": lr, "batch_size": batch_size, "seed": seed, "epoch": epoch,
                                    "train_loss": 1.0 / epoch, "val_map": 50 + 5 * epoch + index, "test_map": 60.0})
        metrics.append({"loss": loss, "lr": 1e-3, "batch_size": 8, "seed": 0, "epoch": 5, "train_loss": None,
                        "val_map": None, "test_map": None, "diverged": True})  # selected, but seed 0 stopped later
        train_scores = np.clip(0.5 * labels + rng.random(labels.shape) * 0.5, 0, 1).astype(np.float16)
        np.savez(run / "scores" / f"{loss}.npz", train=train_scores, val=train_scores[:10], test=train_scores[:10])
        results[loss] = {
            "selected": {"lr": 1e-3, "batch_size": 8, "hparams": {}},
            "best_epoch": [4] * num_seeds, "val_map": 70.0, "val_map_std": 0.0,
            "test_map": float(np.mean(per_seed)), "test_map_std": float(np.std(per_seed)),
            "per_class_ap": list(np.linspace(40, 90, num_classes) + index),
            "per_seed": [{"seed": s, "best_epoch": 4, "val_map": 70.0, "test_map": v} for s, v in enumerate(per_seed)],
            "configs": [],
        }
        if train_map:
            results[loss]["train_map"] = 80.0 + index
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in metrics))
    if complete:
        (run / "results.json").write_text(json.dumps(
            {"stage": stage, "dataset": dataset, "cache_id": cache_id, "complete": True, "losses": results}))
    return run


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "voc", "linear", {"bce": [90.0, 90.0, 90.0], "an": [84.0, 85.0, 86.0], "role": [86.0, 87.0, 88.0]},
             stamp="20240101-120000")
    make_run(root, "coco", "finetune", {"role": [68.5]}, stamp="20240102-120000")
    return root


def table_of(paths, **kwargs):
    return report.build_table(report.collect_runs(paths), **kwargs)


def cells_by_loss(table, label):
    return {loss: cells[label] for loss, cells in table.rows if label in cells}


def test_table_mean_std_and_best_single_positive(runs):
    table = table_of([runs])
    assert [c.label for c in table.columns] == ["VOC linear", "COCO fine-tuned"]
    assert [loss for loss, _ in table.rows] == ["bce", "an", "role"]  # spec order: oracles first
    voc = cells_by_loss(table, "VOC linear")
    # mean of (84, 85, 86) = 85, std = sqrt(2/3) = 0.8165 (what results.json says), three seeds
    assert report.cell_text(voc["an"]) == "85.00 ± 0.82"
    assert voc["an"].seeds == 3
    # one seed: the mean alone
    assert report.cell_text(cells_by_loss(table, "COCO fine-tuned")["role"]) == "68.50"
    # bce is higher but an oracle: the best single-positive loss is role, as the papers mark it
    assert [loss for loss, cell in voc.items() if cell.best] == ["role"]


def test_terminal_table_lists_every_loss_and_marks_best(runs):
    console = Console(file=io.StringIO(), width=200)
    report.print_report([runs], console=console)
    text = console.file.getvalue()
    assert "BCE (oracle)" in text and "85.00 ± 0.82" in text and "87.00 ± 0.82 *" in text
    assert "│ AN " in text and "│ ROLE " in text and "│ an " not in text  # the papers' names, not the registry's
    assert "90.00 *" not in text


def parse_markdown(text):
    """The first table of a Markdown report (every metric's tables follow the notes)."""
    lines = text.splitlines()
    first = lines[: lines.index("")] if "" in lines else lines
    rows = [line.strip("|").split("|") for line in first if line.startswith("|")]
    header = [h.strip() for h in rows[0]]
    return header, [[c.strip() for c in row] for row in rows[2:]]


@pytest.mark.parametrize("fmt", ["csv", "md", "json"])
def test_file_formats_round_trip(runs, tmp_path, fmt):
    output = tmp_path / "out" / f"table.{fmt}"
    report.report_command(report.ReportOptions([], runs_root=runs, paper=True, output=output),
                          Console(file=io.StringIO()))
    text = output.read_text()
    assert list(output.parent.iterdir()) == [output]  # no temporary file left behind
    expected = {"an": (85.0, 0.8165, 84.2), "role": (87.0, 0.8165, 86.5), "bce": (90.0, 0.0, 86.7)}
    if fmt == "csv":
        rows = {row["loss"]: row for row in csv.DictReader(io.StringIO(text))}
        for loss, (mean, std, published) in expected.items():
            assert float(rows[loss]["VOC linear mean"]) == pytest.approx(mean)
            assert float(rows[loss]["VOC linear std"]) == pytest.approx(std, abs=1e-4)
            assert float(rows[loss]["VOC linear paper"]) == published
            assert float(rows[loss]["VOC linear diff"]) == pytest.approx(mean - published)
        assert rows["role"]["VOC linear best"] == "1" and rows["an"]["VOC linear best"] == "0"
        assert float(rows["role"]["COCO fine-tuned mean"]) == 68.5 and rows["role"]["COCO fine-tuned std"] == ""
        assert float(rows["role"]["COCO fine-tuned paper"]) == 69.0
    elif fmt == "md":
        header, rows = parse_markdown(text)
        column = header.index("VOC linear")
        by_loss = {row[0].replace(" (oracle)", ""): row for row in rows}
        assert sorted(by_loss) == ["AN", "BCE", "ROLE"]  # the papers' names in Markdown; CSV and JSON keep the registry's
        by_loss = {loss: by_loss[losses.display_name(loss)] for loss in expected}
        for loss, (mean, std, published) in expected.items():
            cell = by_loss[loss][column]
            assert cell.startswith("**") == (loss == "role")
            numbers = [float(x) for x in cell.strip("*").split(" ± ")]
            assert numbers == pytest.approx([mean, std], abs=0.005)
            assert float(by_loss[loss][column + 1]) == published
            assert float(by_loss[loss][column + 2]) == pytest.approx(mean - published, abs=0.005)
        assert "Cole et al. 2021, Table 1" in text and "Multi-Label Learning from Single Positive Labels, CVPR 2021" in text
    else:
        payload = json.loads(text)
        rows = {row["loss"]: row for row in payload["rows"]}
        assert rows["bce"]["oracle"] and not rows["an"]["oracle"]
        assert (rows["bce"]["display_name"], rows["role"]["display_name"]) == ("BCE", "ROLE")
        for loss, (mean, std, published) in expected.items():
            cell = rows[loss]["cells"]["VOC linear"]
            assert (cell["mean"], cell["paper"], cell["seeds"]) == (pytest.approx(mean), published, 3)
            assert cell["std"] == pytest.approx(std, abs=1e-4) and cell["best"] == (loss == "role")
            assert cell["diff"] == pytest.approx(mean - published)


def test_paper_numbers_match_protocol(tmp_path):
    # restated from docs/protocol.md
    make_run(tmp_path, "nus", "linear", {"an_ls": [40.0], "epr": [40.0], "role": [40.0]}, stamp="20240101-000000")
    make_run(tmp_path, "cub", "linear", {"bce_ls": [20.0], "wan": [20.0]}, stamp="20240101-000000")
    make_run(tmp_path, "voc", "finetune", {"em": [80.0], "gr": [80.0], "an_ls": [80.0]}, stamp="20240101-000000")
    make_run(tmp_path, "cub", "finetune", {"opml_sp": [20.0], "em_apl": [20.0]}, stamp="20240101-000000")
    make_run(tmp_path, "coco", "finetune", {"opml": [60.0], "role": [60.0], "entmin": [60.0]}, stamp="20240101-000000",
             weights="none")
    published = {
        ("NUS linear", "an_ls"): (48.5, "Cole"), ("NUS linear", "epr"): (46.4, "Cole"), ("NUS linear", "role"): (49.5, "Cole"),
        ("CUB linear", "bce_ls"): (29.3, "Cole"), ("CUB linear", "wan"): (17.9, "Cole"),
        ("VOC fine-tuned", "em"): (89.09, "Zhou"), ("VOC fine-tuned", "gr"): (89.83, "Chen"),
        ("VOC fine-tuned", "an_ls"): (86.5, "Cole"), ("CUB fine-tuned", "opml_sp"): (24.11, "Li e"),
        ("CUB fine-tuned", "em_apl"): (21.84, "Zhou"), ("COCO fine-tuned", "opml"): (68.93, "Li e"),
        ("COCO fine-tuned", "role"): (69.0, "Cole"), ("COCO fine-tuned", "entmin"): (None, None),
    }
    table = table_of([tmp_path], paper=True)
    for (label, loss), (value, seed) in published.items():
        cell = cells_by_loss(table, label)[loss]
        assert cell.paper == value, (label, loss)
        assert (cell.source or "")[:4] == (seed or "")
    assert "LinearInit" in cells_by_loss(table, "COCO fine-tuned")["role"].source
    assert cells_by_loss(table, "VOC linear") == {}
    # only the column whose cache was not made with the papers' backbone weights gets the warning
    assert [note.split(":")[0] for note in table.notes if "not like for like" in note] == ["COCO fine-tuned"]


def test_finetune_from_imagenet_is_its_own_column(tmp_path):
    make_run(tmp_path, "voc", "finetune", {"em": [88.0]}, stamp="20240101-000000", init="best")
    make_run(tmp_path, "voc", "finetune", {"em": [87.0]}, stamp="20240102-000000", init="imagenet")
    table = table_of([tmp_path], paper=True)
    assert [c.label for c in table.columns] == ["VOC fine-tuned", "VOC fine-tuned from ImageNet"]
    linear_init, imagenet = (cells_by_loss(table, c.label)["em"] for c in table.columns)
    assert (linear_init.mean, imagenet.mean) == (88.0, 87.0)
    assert linear_init.paper == imagenet.paper == 89.09  # Zhou et al. Table 1
    assert table.notes == []  # two experiments, not a newer run of the same one


def test_a_fine_tuned_row_that_ends_below_its_start_is_marked(tmp_path):
    run = make_run(tmp_path, "voc", "finetune", {"an_ls": [10.07], "role": [60.0]}, stamp="20240101-000000",
                   init="best")
    results = json.loads((run / "results.json").read_text())
    starts = {"an_ls": 38.40, "role": 55.0}  # an_ls fell from its start (the demo's case), role rose above its own
    for loss, start in starts.items():
        results["losses"][loss]["start"] = {"val_map": 40.0, "test_map": start}
    (run / "results.json").write_text(json.dumps(results))
    console = Console(file=io.StringIO(), width=200)
    report.print_report([tmp_path], console=console)
    text = console.file.getvalue()
    below = [loss for loss, start in starts.items() if results["losses"][loss]["test_map"] < start]
    assert below == ["an_ls"] and "10.07 ↓" in text and "60.00 ↓" not in text
    assert "↓ an_ls, VOC fine-tuned: fine-tuning ended below its start (test mAP 38.40 before any step" in text
    assert "↓ role" not in text


def read_png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24]), len(data)


def test_plots_are_valid_pngs(runs, tmp_path):
    out = tmp_path / "figures"
    written = report.write_plots([runs], out)
    kinds = ("val_curves", "train_histograms", "label_recovery")
    expected = {f"voc_linear-{kind}.png" for kind in kinds + ("per_class_ap",)}
    # the per-class figure needs two losses: the COCO column has only one
    expected |= {f"coco_fine_tuned-{kind}.png" for kind in kinds}
    assert {path.name for path in written} == expected
    for path in written:
        (width, height), size = read_png_size(path)
        assert width >= 500 and height >= 250 and size > 10_000, path
    assert sorted(out.iterdir()) == sorted(written)


def test_compare_pair_default_and_unknown_loss(runs, tmp_path):
    by_loss = {run_loss: run for (label, run_loss), run in report.select_newest(report.collect_runs([runs]))[1].items()
               if label == "VOC linear"}
    oracles = {"bce", "bce_ls", "iun"}
    # default: the two best single-positive losses by test mAP (role 87 > an 85), the better one second
    assert plots._pair_for(by_loss, None, oracles) == ("an", "role")
    assert plots._pair_for(by_loss, ("bce", "an"), oracles) == ("bce", "an")
    assert plots._pair_for(by_loss, ("an", "em"), oracles) is None  # this column lacks em
    with pytest.raises(SpmlError, match="no run has loss em.*available: an, bce, role"):
        report.write_plots([runs], tmp_path / "b", compare="an,em")
    with pytest.raises(SpmlError, match="two different loss names"):
        report.write_plots([runs], tmp_path / "b", compare="an")
    assert not (tmp_path / "b").exists()


def drawn_figures(root, label="VOC linear", pair=None):
    """The four figures of one column, drawn as plot_runs draws them, as Figure objects to inspect."""
    Figure = plots.require_matplotlib()
    by_loss = {loss: run for (column, loss), run in report.select_newest(report.collect_runs([root]))[1].items()
               if column == label}
    by_loss = {name: by_loss[name] for name in collect.in_spec_order(by_loss)}
    oracles = collect.oracle_losses()
    summaries = {loss: plots._train_summary(run, loss) for loss, run in by_loss.items()}
    return {
        "val_curves": val_curves.draw(Figure, label, by_loss, oracles),
        "per_class_ap": plots._per_class_ap(Figure, label, by_loss, plots._pair_for(by_loss, pair, oracles)),
        "train_histograms": plots._train_histograms(Figure, label, summaries),
        "label_recovery": plots._label_recovery(Figure, label, by_loss, summaries),
    }


def assert_labelled(axes):
    assert axes.get_xlabel() and axes.get_ylabel() and axes.get_title(), axes
    legend = axes.get_legend()
    assert legend is not None and all(text.get_text() for text in legend.get_texts()), axes.get_title()
    return [text.get_text() for text in legend.get_texts()]


def test_many_losses_val_curves_one_panel_per_family(tmp_path):
    names = losses.names()[:20]  # bce ... ll_r: oracles, assume negative (8), estimating, acknowledge, robust, ll_r
    make_run(tmp_path, "voc", "linear", {name: [60.0 + i] for i, name in enumerate(names)}, stamp="20240101-000000")
    figure = drawn_figures(tmp_path)["val_curves"]
    panels = figure.get_axes()
    families = list(dict.fromkeys(collect.loss_family(name) for name in names))
    assert families == ["oracles", "assume_negative", "estimating", "acknowledge", "robust", "large_loss"]
    assert len(panels) == 1 + len(families)
    # the first panel: the best 4 single-positive losses by test mAP (ll_r 79 > splc 78 > hill 77 > asl 76),
    # best first, and the best oracle (iun 62 > bce_ls 61 > bce 60)
    legend = assert_labelled(panels[0])
    assert [text.split(":")[0] for text in legend] == ["#1 LL-R", "#2 SPLC", "#3 Hill", "#4 ASL", "IUN"]  # as the
    registry = {losses.display_name(name): name for name in names}  # papers name them; back to the registry's
    shown, panel_families = [], []
    for axes in panels:
        legend = assert_labelled(axes)
        lines = axes.get_lines()
        assert len(legend) == len(lines) <= val_curves.MAX_LINES
        assert len({to_hex(line.get_color()) for line in lines}) == len(lines), axes.get_title()  # distinct colours
        assert axes.get_ylim() == panels[0].get_ylim() and axes.get_xlim() == panels[0].get_xlim()
        if axes is not panels[0]:
            in_panel = [registry[re.sub(r"^#\d+ ", "", text.split(":")[0])] for text in legend]
            panel_families.append({collect.loss_family(name) for name in in_panel})
            shown += in_panel
    assert shown == names  # every loss once, in spec order,
    assert panel_families == [{family} for family in families]  # in its family's panel
    # a best loss keeps its colour and is drawn bold in its family panel too
    by_label = {line.get_label(): line for axes in panels for line in axes.get_lines()}
    best = [line for label, line in by_label.items() if label.startswith("#1 ")]
    assert len({to_hex(line.get_color()) for line in panels[0].get_lines()[:1] + best}) == 1
    thin = [line.get_linewidth() for label, line in by_label.items() if "#" not in label]
    assert min(line.get_linewidth() for line in best) > max(thin)


def test_val_curves_split_a_family_beyond_ten_lines():
    curves = {f"new{i}": ([1], [50.0], {}) for i in range(12)} | {"bce": ([1], [50.0], {})}
    panels, best = val_curves.panels_for(curves, {name: float(i) for i, name in enumerate(curves)}, {"bce"})
    assert best == ["new11", "new10", "new9", "new8"]
    assert [(title, len(names)) for title, names in panels] == [
        ("the best 4 single-positive losses and the best oracle", 5), ("other (12 losses, part 1/2)", 10),
        ("other (12 losses, part 2/2)", 2), ("oracles (1 loss)", 1)]
    few = {name: curves[name] for name in ["new0", "new1", "bce"]}
    assert val_curves.panels_for(few, {"new0": 1.0, "new1": 2.0, "bce": 3.0}, {"bce"}) == (
        [("all losses", ["new0", "new1", "bce"])], ["new1", "new0"])


def test_every_panel_of_the_other_figures_has_labels_and_legend(runs):
    figures = drawn_figures(runs)
    histograms = figures["train_histograms"].get_axes()
    assert len(histograms) == 3
    for axes in histograms:
        legend = assert_labelled(axes)
        assert (axes.get_xlabel(), axes.get_ylabel()) == ("predicted probability", "density (log)")
        assert [text.split(",")[0] for text in legend] == ["true negatives", "true positives"]
        assert axes.get_ylim() == histograms[0].get_ylim()
    top, bottom = figures["per_class_ap"].get_axes()
    assert [text.split(" (")[0] for text in assert_labelled(top)] == ["AN", "ROLE"]
    assert assert_labelled(bottom) == ["ROLE better", "AN better"]
    (recovery,) = figures["label_recovery"].get_axes()
    assert assert_labelled(recovery) == ["train mAP vs full labels", "test mAP"]


def test_train_summary_computed_from_scores_when_results_lack_train_map(tmp_path):
    run_dir = make_run(tmp_path, "voc", "linear", {"an": [80.0]}, stamp="20240101-000000", train_map=False)
    with np.load(run_dir / "scores" / "an.npz") as s, np.load(run_dir / "labels.npz") as labels:
        train, full, observed = s["train"].astype(np.float32), labels["train_labels"], labels["train_observed"]
    summary = plots._train_summary(report.read_run(run_dir), "an")
    # spec: mean over all classes of sklearn's AP against the *full* training labels, 0-100
    expected = 100 * np.mean([average_precision_score(full[:, c], train[:, c]) for c in range(full.shape[1])])
    assert summary["train_map"] == pytest.approx(expected, abs=1e-4)
    # histograms: densities over 25 equal bins of [0, 1] (integrate to 1) of unobserved true positives/negatives
    for name, mask in (("positives", (observed == 0) & (full == 1)), ("negatives", (observed == 0) & (full == 0))):
        density, mean = summary[name]
        assert density.sum() / 25 == pytest.approx(1.0) and mean == pytest.approx(train[mask].mean())


def test_no_runs_says_where_it_looked(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpmlError, match="no run directories found under .*empty"):
        report.collect_runs([tmp_path / "empty"])
    with pytest.raises(SpmlError, match="no runs found: .*missing does not exist"):
        report.collect_runs(runs_root=tmp_path / "missing")


def test_different_caches_are_reported_apart(tmp_path):
    make_run(tmp_path, "voc", "linear", {"an": [84.0]}, stamp="20240101-000000", cache_id="aaaa1111ffff")
    make_run(tmp_path, "voc", "linear", {"an": [70.0]}, stamp="20240102-000000", cache_id="bbbb2222ffff")
    table = table_of([tmp_path])
    labels = sorted(c.label for c in table.columns)
    assert labels == ["VOC linear (cache aaaa1111)", "VOC linear (cache bbbb2222)"]
    assert cells_by_loss(table, labels[0])["an"].mean == 84.0 and cells_by_loss(table, labels[1])["an"].mean == 70.0
    assert any("2 different caches" in note for note in table.notes)


def test_newest_run_wins_and_older_ones_are_named(tmp_path):
    old = make_run(tmp_path, "voc", "linear", {"an": [80.0], "role": [81.0]}, stamp="20240101-000000")
    new = make_run(tmp_path, "voc", "linear", {"an": [83.0]}, stamp="20240301-000000")
    table = table_of([tmp_path])
    voc = cells_by_loss(table, "VOC linear")
    assert (voc["an"].mean, voc["an"].run.name, voc["role"].mean) == (83.0, new.name, 81.0)
    assert any(old.name in note and new.name in note and note.startswith("an ") for note in table.notes)


def test_incomplete_run_is_listed_not_tabulated(runs):
    broken = make_run(runs, "voc", "linear", {"epr": [99.0]}, stamp="20240105-000000", complete=False)
    garbled = make_run(runs, "voc", "linear", {"wan": [99.0]}, stamp="20240106-000000")
    (garbled / "results.json").write_text('{"stage": "lin')
    diverged = make_run(runs, "voc", "linear", {"pr": [99.0]}, stamp="20240107-000000")
    results = json.loads((diverged / "results.json").read_text())
    results["losses"]["pr"] = {"selected": None, "error": "every head diverged in its first epoch", "configs": []}
    (diverged / "results.json").write_text(json.dumps(results))
    table = table_of([runs])
    assert {loss for loss, _ in table.rows} == {"bce", "an", "role"}
    assert any(note.startswith("pr (VOC linear)") and "diverged" in note for note in table.notes)
    problems = {run.path.name: run.problem for run in table.incomplete}
    assert "no results.json" in problems[broken.name] and "not valid JSON" in problems[garbled.name]
    console = Console(file=io.StringIO(), width=300)
    report.print_table(table, console)
    assert f"incomplete, not tabulated: {broken}" in console.file.getvalue()


def test_missing_matplotlib_is_a_clear_error(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(SpmlError, match="--plots needs matplotlib"):
        report.write_plots([runs], tmp_path / "figures")
    with pytest.raises(SpmlError, match="--plots needs matplotlib"):
        report.report_command(report.ReportOptions([], runs_root=runs, fmt="csv", output=tmp_path / "t.csv",
                                                   plots_dir=tmp_path / "figures"), Console(file=io.StringIO()))
    assert not (tmp_path / "figures").exists() and not (tmp_path / "t.csv").exists()


def test_cli_report_from_a_subprocess(runs):
    done = run_cli("report", "--paper", "--format", "json", "--out", "t.json", cwd=runs.parent)
    assert done.returncode == 0, done.stderr
    cell = {r["loss"]: r for r in json.loads((runs.parent / "t.json").read_text())["rows"]}["an"]["cells"]["VOC linear"]
    assert (cell["mean"], cell["paper"]) == (85.0, 84.2)
    assert "wrote t.json" in done.stdout and "Cole et al. 2021: E. Cole" in done.stdout  # the notes on the terminal


@pytest.mark.parametrize("flag", ["--out", "--plots"])
def test_a_place_that_cannot_be_written_is_one_line(runs, flag, monkeypatch, capsys):
    blocker = runs.parent / "a-file"
    blocker.write_text("not a folder")
    target = blocker / ("table.csv" if flag == "--out" else "figures")
    if flag == "--out":  # from a subprocess, as a user types it; the other in this process
        done = run_cli("report", flag, str(target), cwd=runs.parent)
        code, stderr = done.returncode, done.stderr
    else:
        code, stderr = run_main("report", flag, str(target), cwd=runs.parent, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"error: {flag} {target}: cannot write") and "pick a writable place" in line


def test_runs_with_the_authors_numerics_get_their_own_column(tmp_path):
    make_run(tmp_path, "voc", "linear", {"an": [84.0]}, stamp="20240101-000000")
    authors = make_run(tmp_path, "voc", "linear", {"an": [80.0]}, stamp="20240102-000000")
    config = json.loads((authors / "config.json").read_text())
    (authors / "config.json").write_text(json.dumps({**config, "fidelity": "authors"}))
    table = table_of([tmp_path], paper=True)
    assert [c.label for c in table.columns] == ["VOC linear", "VOC linear (authors' numerics)"]
    exact, theirs = (cells_by_loss(table, c.label)["an"] for c in table.columns)
    assert (exact.mean, theirs.mean) == (84.0, 80.0) and exact.paper == theirs.paper == 84.2
    assert table.notes == []  # not "the newest of two runs": two modes, two columns


def test_a_run_whose_test_split_scored_no_class_is_n_a_and_never_ranked(tmp_path):
    """A run trained before `linear` refused a test split without an annotated positive (issue 36): every test
    mAP 0.00, which the table must not star as the best loss nor the figures rank."""
    root = tmp_path / "runs"
    make_run(root, "voc", "linear", {"role": [30.0]}, stamp="20240101-120000")
    unscored = make_run(root, "voc", "linear", {"an": [0.0], "bce": [0.0]}, stamp="20240102-120000")
    results = json.loads((unscored / "results.json").read_text())
    results["partial_test_labels"] = {"annotated_fraction": 0.0, "classes_scored": 0, "classes_left_out": 5}
    (unscored / "results.json").write_text(json.dumps(results))
    voc = cells_by_loss(table_of([root]), "VOC linear")
    assert {loss: report.cell_text(cell) for loss, cell in voc.items()} == {"bce": "n/a", "an": "n/a",
                                                                              "role": "30.00"}
    assert [loss for loss, cell in voc.items() if cell.best] == ["role"]  # scored, even below the 0.00s' rank
    console = Console(file=io.StringIO(), width=200)
    report.print_report([root], console=console)
    assert "n/a *" not in console.file.getvalue() and "30.00 *" in console.file.getvalue()
    alone = table_of([unscored])  # a column of n/a only: nothing is best
    assert [cell.best for _, cells in alone.rows for cell in cells.values()] == [False, False]
    # the figures leave it out too: no second scored single-positive loss, so no per-class AP comparison
    written = plots.write_plots([root], tmp_path / "figures")
    assert written and not [path for path in written if path.name.endswith("per_class_ap.png")]
