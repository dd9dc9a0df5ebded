"""Observation rules through the stages: `extract --observe` stores their masks beside `single`'s (a complete cache
gets the missing ones without recomputing), `linear --observe` trains every loss under every rule (drawing what
the cache lacks), keys results by rule and resumes by rule; a `single` run's files stay as they were."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from cli_support import run_cli
from extract_support import RESOLUTION, write_numbered_csv_dataset
from linear_support import quiet, write_synthetic_cache

from spml_cache import cache, datasets, observation, protocol, runs
from spml_cache.demo.data import make_demo_data
from spml_cache.extract import extract
from spml_cache.linear import LinearOptions, LinearSettings, run_linear
from spml_cache.linear.parts import KeptParts
from spml_cache.observation import Areas, parse_rules
from spml_cache.runtime.errors import Interrupted, SpmlError

GRID = dict(lrs=[1e-2], batch_sizes=[8], epochs=2, seeds=1)
# The demo cache is extracted with --weights none (no weights file to write): its warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore::spml_cache.backbones.checkpoints.RandomWeightsWarning")


@pytest.fixture(scope="module")
def voc_cache(tmp_path_factory):
    """The demo VOC dataset extracted with --observe single,entry:0.5,largest."""
    root = make_demo_data(tmp_path_factory.mktemp("voc"), num_train=12, num_test=4, size=40)
    options = dict(weights="none", resolution=RESOLUTION, batch_size=16, workers=0, device="cpu")
    out = tmp_path_factory.mktemp("cache") / "voc.h5"
    report = extract("voc", root, out=out, observe=parse_rules("single,entry:0.5,largest"), **options)
    return root, out, report, options


def test_extract_stores_each_rule_as_linear_would_draw_it(voc_cache):
    root, path, report, _ = voc_cache
    assert "stored observation rules entry:0.5, largest beside single" in report.notes
    loaded = cache.load(path)
    with h5py.File(path, "r") as file:
        assert sorted(file["train/observed_rules"]) == sorted(file["val/observed_rules"]) == ["entry:0.5", "largest"]
    # single's rows as the protocol draws them, over the official training rows before the split
    images = datasets.read("voc", root)
    single = protocol.observe_labels(images.train.labels)
    for split, rows in zip(("train", "val"), protocol.split_train_val(len(single))):
        assert np.array_equal(getattr(loaded, split).observed, single[rows])
    areas = tuple(Areas(*datasets.instance_areas(images, getattr(loaded, split).ids)) for split in ("train", "val"))
    for rule in parse_rules("entry:0.5,largest"):
        drawn = observation.draw_splits(rule, loaded.train.labels, loaded.val.labels, loaded.attrs, areas)
        assert np.array_equal(loaded.train.rules[rule.text], drawn[0])
        assert np.array_equal(loaded.val.rules[rule.text], drawn[1])
    largest = loaded.train.rules["largest"]
    assert ((largest == 1).sum(axis=1) == 1).all() and (loaded.train.labels[largest == 1] == 1).all()


def test_a_complete_cache_gets_missing_rules_without_recomputing(voc_cache, tmp_path):
    root, path, _, options = voc_cache
    copy = tmp_path / "voc.h5"
    copy.write_bytes(path.read_bytes())
    before = cache.load(copy)
    report = extract("voc", root, out=copy, observe=parse_rules("entry:0.5,per-class:1"), **options)
    assert report.status == "up to date" and "added observation rules per-class:1 to the cache" in report.notes
    after = cache.load(copy)
    assert cache.cache_id(after.attrs) == cache.cache_id(before.attrs)
    assert np.array_equal(after.train.features, before.train.features)
    assert set(after.val.rules) == {"entry:0.5", "largest", "per-class:1"}
    assert np.array_equal(after.val.rules["entry:0.5"], before.val.rules["entry:0.5"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["voc.h5"]  # no temporary file left


def test_largest_on_a_dataset_without_areas_writes_nothing(tmp_path, voc_cache):
    write_numbered_csv_dataset(tmp_path / "data", 12, first_test=8)
    out = tmp_path / "csv.h5"
    with pytest.raises(SpmlError, match="--observe largest: csv has no instance areas"):
        extract("csv", tmp_path / "data" / "labels.csv", out=out, observe=parse_rules("largest"), **voc_cache[3])
    assert not out.exists() and not cache.partial_path(out).exists()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("tiny") / "voc-resnet50-448.h5", train=48, val=16, test=24)


def test_single_alone_writes_the_files_it_always_wrote(tmp_path, tiny):
    run = run_linear(cache=tiny, losses=["an"], out=tmp_path, console=quiet(), **GRID).run_dir
    assert set(runs.load_results(run)) == {"stage", "dataset", "cache_id", "complete", "fidelity", "losses"}
    assert runs.read_json(run / "config.json")["observe"] == ["single"]
    assert sorted(np.load(run / "labels.npz")) == ["test_labels", "train_labels", "train_observed", "val_labels"]
    assert all("rule" not in line for line in runs.read_metrics(run))
    assert sorted(p.name for p in (run / "scores").iterdir()) == ["an.npz"]


def without_seconds(entry: dict) -> dict:
    return {key: value for key, value in entry.items() if key not in ("seconds", "loss", "rule")}


def test_every_loss_under_every_rule_equals_a_run_on_that_rule_alone(tmp_path, tiny):
    several = run_linear(cache=tiny, losses=["an", "role"], out=tmp_path / "rules", console=quiet(),
                         observe=parse_rules("single,entry:0.5"), **GRID)
    results = several.results
    assert list(results["losses"]) == ["an", "role", "an@entry:0.5", "role@entry:0.5"]
    assert results["rules"]["entry:0.5"]["source"] == "drawn from the cache's labels"
    alone = run_linear(cache=tiny, losses=["an", "role"], out=tmp_path / "single", console=quiet(), **GRID).results
    for name in ("an", "role"):
        assert without_seconds(results["losses"][name]) == without_seconds(alone["losses"][name])
    # The same losses on a cache whose `observed` holds the rule's masks: the rule's results, number for number.
    features = cache.load(tiny)
    train, val = observation.draw_splits(parse_rules("entry:0.5")[0], features.train.labels, features.val.labels,
                                         features.attrs)
    assert ((train == -1).any() and (train == 1).sum() < (features.train.labels == 1).sum())
    split = lambda part, observed: {"features": part.features, "labels": part.labels, "ids": part.ids,  # noqa: E731
                                    **({"observed": observed} if observed is not None else {})}
    swapped = cache.write(tmp_path / "swapped.h5", attrs=features.attrs, train=split(features.train, train),
                          val=split(features.val, val), test=split(features.test, None))
    on_masks = run_linear(cache=swapped, losses=["an", "role"], out=tmp_path / "swapped", console=quiet(), **GRID)
    for name in ("an", "role"):
        assert (without_seconds(results["losses"][f"{name}@entry:0.5"])
                == without_seconds(on_masks.results["losses"][name]))
        assert results["losses"][f"{name}@entry:0.5"]["rule"] == "entry:0.5"
    best = torch.load(several.run_dir / "best.pt", weights_only=True)
    assert set(best) == set(results["losses"])
    labels = np.load(several.run_dir / "labels.npz")
    assert np.array_equal(labels["train_observed@entry:0.5"], train)
    assert {line.get("rule") for line in runs.read_metrics(several.run_dir)} == {None, "entry:0.5"}


def test_resume_keeps_parts_by_rule(tmp_path, tiny, monkeypatch):
    grid = dict(losses=["an"], observe=parse_rules("single,keep-pos:0.5"), lrs=[1e-2], batch_sizes=[4, 8], epochs=2)
    whole = run_linear(cache=tiny, out=tmp_path / "whole", console=quiet(), **grid)
    kept = KeptParts.keep

    def stopped_after_three(self, *args):
        kept(self, *args)
        if len(list(self.folder.glob("*.pt"))) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(KeptParts, "keep", stopped_after_three)
    with pytest.raises(Interrupted, match="3 of 4 \\(loss, rule, seed, batch size\\) parts"):
        run_linear(cache=tiny, out=tmp_path / "cut", console=quiet(), **grid)
    monkeypatch.setattr(KeptParts, "keep", kept)
    (run_dir,) = (tmp_path / "cut" / "voc").iterdir()
    assert sorted(p.name for p in (run_dir / "jobs").glob("*.pt"))[-1] == "an_keep-pos_0.5-seed0-batch4.pt"
    resumed = run_linear(resume=run_dir, console=quiet())
    assert {k: without_seconds(v) for k, v in resumed.results["losses"].items()} == {
        k: without_seconds(v) for k, v in whole.results["losses"].items()}


def test_a_loss_that_needs_a_positive_is_refused_when_named_and_left_out_of_all(tmp_path, tiny):
    with pytest.raises(SpmlError, match=r"^--observe entry:0.2 with --loss pr: \d+ of 48 training images"):
        run_linear(cache=tiny, losses=["an", "pr"], out=tmp_path, observe=parse_rules("entry:0.2"), console=quiet(),
                   **GRID)
    assert not tmp_path.joinpath("voc").exists()
    settings_all = LinearSettings.of(LinearOptions(losses="all", lrs=[1e-2], batch_sizes=[8], epochs=1, seeds=1,
                                                   observe=parse_rules("single,entry:0.2")))
    features = cache.load(tiny)
    units, notes = settings_all.units(observation.for_cache(features, settings_all.options.observe), features.train.labels)
    assert "pr" in units and "pr@entry:0.2" not in units and "an@entry:0.2" in units
    assert len(notes) == 1 and notes[0].startswith("--loss all: pr left out under entry:0.2 (")


def test_cli_linear_under_rules_from_a_cache_with_and_without_them(voc_cache, tiny, tmp_path):
    _, with_rules, _, _ = voc_cache
    done = run_cli("linear", "--cache", str(with_rules), "--loss", "an", "--observe", "entry:0.5,per-class:2",
                   "--epochs", "1", "--lr", "1e-2", "--batch-size", "4", "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"observation rule per-class:2 drawn from the full labels of {with_rules}" in done.stderr
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    results = runs.load_results(run_dir)
    assert list(results["losses"]) == ["an@entry:0.5", "an@per-class:2"]
    assert results["rules"]["entry:0.5"]["source"] == "cache"
    assert "an@entry:0.5" in done.stdout and runs.read_json(run_dir / "config.json")["observe"] == [
        "entry:0.5", "per-class:2"]
    refused = run_cli("linear", "--cache", str(tiny), "--loss", "an", "--observe", "largest", cwd=tmp_path)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("error: --observe largest: needs instance areas (VOC boxes)")
    refused = run_cli("linear", "--cache", str(with_rules), "--loss", "pr", "--observe", "entry:0.5", cwd=tmp_path)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert "error: --observe entry:0.5 with --loss pr: " in refused.stderr
    assert "leave pr out of --loss" in refused.stderr
    assert sorted(p.name for p in (tmp_path / "runs" / "voc").iterdir()) == [run_dir.name]  # nothing more written
