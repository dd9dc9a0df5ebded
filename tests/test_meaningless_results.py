"""Results that look real and are not (issue 36, item 5): inputs whose every result would be 0.00, or the mAP of
untrained heads, or a grid trained on no observed label, are refused in one line before anything is written; and
`report` never ranks a result whose test split scored no class (an older run's), showing n/a instead."""

from pathlib import Path

import h5py
import numpy as np
import pytest

from cli_support import run_cli, run_main
from linear_support import quiet, write_synthetic_cache
from spml_cache import cache, observation
from spml_cache.cache.csr import stored_sparse
from spml_cache.labels import SparseLabels
from spml_cache.linear import run_linear
from spml_cache.runtime.errors import SpmlError

GRID = {"losses": "an", "lrs": [1e-2], "batch_sizes": [8], "epochs": 1}


def rewritten(source: Path, target: Path, change, labels: str = "auto") -> Path:
    """A copy of cache `source` written anew through `cache.write`, its split dicts first passed to `change`."""
    features = cache.load(source)
    splits = {}
    for name in cache.SPLITS:
        split = getattr(features, name)
        splits[name] = {"features": split.features, "labels": split.labels, "ids": list(split.ids)}
        if split.observed is not None:
            splits[name]["observed"] = split.observed
    change(splits)
    return cache.write(target, attrs={key: features.attrs[key] for key in (
        "dataset", "classes", "num_classes", "backbone", "weights", "resolution", "feature_dim", "split_seed",
        "val_frac", "observe_seed", "num_pos", "num_neg", "expected_positives")}, labels=labels, **splits)


def emptied(name: str):
    def change(splits):
        split = splits[name]
        for key, array in list(split.items()):
            split[key] = array[:0]
    return change


def masked_test(mask_of):
    def change(splits):
        splits["test"]["label_mask"] = mask_of(splits["test"]["labels"]).astype(np.uint8)
    return change


def unobserved(splits):
    splits["train"]["observed"] = np.zeros_like(splits["train"]["observed"])


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=40, val=16, test=20,
                                 classes=4, dim=8)


REFUSED = [
    ("empty train", emptied("train"), "its train split has no rows"),
    ("empty test", emptied("test"), "its test split has no rows"),
    ("test cells all unknown", masked_test(np.zeros_like), "its test split has no annotated positive label"),
    ("test positives all unknown", masked_test(lambda labels: labels == 0), "no annotated positive label"),
    ("no test positive", lambda splits: splits["test"].update(labels=np.zeros_like(splits["test"]["labels"])),
     "its test split has no positive label in 20 rows"),
    ("all-zero observed", unobserved, "no training label is observed under single"),
]


@pytest.mark.parametrize("change, message", [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_a_cache_whose_results_would_mean_nothing_is_refused(tmp_path, tiny_cache, change, message):
    bad = rewritten(tiny_cache, tmp_path / "voc-resnet50-448.h5", change)
    with pytest.raises(SpmlError, match=message) as refused:
        run_linear(cache=bad, out=tmp_path / "runs", console=quiet(), **GRID)
    assert str(refused.value).startswith(f"{bad}: ")
    assert not (tmp_path / "runs").exists()


def test_one_annotated_test_positive_is_enough(tmp_path, tiny_cache):
    """The boundary of the refusal: a single known positive test cell gives a test mAP that means something."""
    def one_known_positive(labels):
        mask = np.zeros_like(labels)
        row, column = np.argwhere(labels == 1)[0]
        mask[row, column] = 1
        return mask

    cache_path = rewritten(tiny_cache, tmp_path / "voc-resnet50-448.h5", masked_test(one_known_positive))
    done = run_linear(cache=cache_path, out=tmp_path / "runs", console=quiet(), **GRID)
    assert done.results["partial_test_labels"]["classes_scored"] == 1


def test_sparse_test_labels_without_an_annotated_positive_are_refused(tmp_path, tiny_cache):
    def sparse_partial(splits):
        for split in splits.values():
            for key in ("labels", "observed"):
                if key in split:
                    split[key] = SparseLabels.from_dense(split[key])
        labels = splits["test"]["labels"].to_dense()
        splits["test"]["label_mask"] = SparseLabels.from_dense((labels == 0).astype(np.uint8))

    bad = rewritten(tiny_cache, tmp_path / "voc-resnet50-448.h5", sparse_partial, labels="sparse")
    with h5py.File(bad) as file:
        assert stored_sparse(file["test"]["labels"]) and stored_sparse(file["test"]["label_mask"])
    with pytest.raises(SpmlError, match="no annotated positive label"):
        run_linear(cache=bad, out=tmp_path / "runs", console=quiet(), **GRID)
    assert not (tmp_path / "runs").exists()


def test_a_test_split_without_annotated_positives_is_one_line_from_the_command_line(tmp_path, tiny_cache):
    bad = rewritten(tiny_cache, tmp_path / "voc-resnet50-448.h5", masked_test(np.zeros_like))
    done = run_cli("linear", "--cache", str(bad), "--loss", "an", "--epochs", "1", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {bad}: its test split has no annotated positive label")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("rule", ["per-class:0", "uniform:pos=0,neg=0", "uniform:pos=0,neg=0,seed=3",
                                  "per-class:n=0,seed=9"])
def test_rules_that_observe_nothing_are_refused_when_parsed(tmp_path, monkeypatch, capsys, tiny_cache, rule):
    code, err = run_main("linear", "--cache", str(tiny_cache), "--loss", "an", "--observe", rule, cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: --observe {rule}: observes no label at all")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("rule", ["per-class:1", "uniform:pos=0,neg=1", "uniform:pos=1,neg=0"])
def test_rules_that_observe_something_still_parse(rule):
    (parsed,) = observation.parse_rules(rule)
    labels = np.eye(4, dtype=np.uint8)[[0, 1, 2, 3, 0, 1]]
    assert np.count_nonzero(parsed.draw(labels)) > 0  # the boundary: each of these shows at least one label


def test_a_rule_whose_draw_shows_nothing_is_refused_before_training(tmp_path, tiny_cache, monkeypatch):
    """Whatever the rule, a drawn observed matrix without a single label is refused (here `keep-pos` drawn from
    labels stripped of every positive in train)."""
    def no_train_positive(splits):
        splits["train"]["labels"] = np.zeros_like(splits["train"]["labels"])
        splits["train"]["observed"] = np.zeros_like(splits["train"]["observed"]) - 1  # the cache's own: negatives

    bad = rewritten(tiny_cache, tmp_path / "voc-resnet50-448.h5", no_train_positive)
    with pytest.raises(SpmlError, match="no training label is observed under keep-pos:0.5 .*choose an --observe rule"):
        run_linear(cache=bad, out=tmp_path / "runs", console=quiet(), observe=observation.parse_rules("keep-pos:0.5"),
                   **GRID)
    assert not (tmp_path / "runs").exists()
