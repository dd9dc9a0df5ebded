"""A run's config.json edited by hand or damaged, read back by `--resume` (issue 56, item 7): a value its option's
declaration refuses is the file's, named by its key (`RUN/config.json: epochs -1: ...`), never a flag that was not
given; a config.json cut short is named with the fix. Both stages, and each shape a config.json has had."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import one_error_line
from linear_support import interrupted_run, write_synthetic_cache

from spml_cache.linear.parts import KeptParts
from spml_cache.options import FinetuneOptions, LinearOptions
from spml_cache.runtime.errors import SpmlError

DAMAGED = "(the run's record was edited or damaged: start a new run)"
GRID = dict(losses=["an"], lrs=[1e-2, 1e-3], batch_sizes=[4, 8], epochs=2, seeds=1)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A linear run stopped after its first part, and its config.json as written."""
    folder = tmp_path_factory.mktemp("edited")
    cache_path = write_synthetic_cache(folder / "voc-resnet50-448.h5", train=40, val=16, test=20)
    monkeypatch = pytest.MonkeyPatch()
    try:
        run_dir = interrupted_run(folder / "runs", cache_path, monkeypatch, 1, **GRID)
    finally:
        monkeypatch.undo()
    return run_dir, json.loads((run_dir / "config.json").read_text())


def nested(config: dict) -> dict:
    """The shape before each setting was kept once: every option under `options`."""
    options = {name: config.pop(name) for name in LinearOptions.declared() if name in config}
    return {**config, "options": options}


@pytest.mark.parametrize("shape, key, value, said", [
    ("flat", "epochs", -1, "epochs -1: use at least 1"),
    ("flat", "lrs", ["abc"], "lrs 'abc': use a number"),
    ("flat", "lrs", [], "lrs is empty: give at least one value"),
    ("flat", "seeds", "two", "seeds 'two': use a whole number"),
    ("flat", "observe", ["entry:2"], "observe entry:2"),
    ("nested", "epochs", -1, "options.epochs -1: use at least 1"),
    ("nested", "batch_sizes", [8, 0], "options.batch_sizes 8,0: every value must be positive and whole"),
])  # fmt: skip
def test_an_edited_value_is_blamed_on_the_file_and_its_key(stopped, tmp_path, monkeypatch, capsys, shape, key, value,
                                                            said):
    run_dir, written = stopped
    config = dict(written)
    config[key] = value
    (run_dir / "config.json").write_text(json.dumps(nested(config) if shape == "nested" else config))
    try:
        line = one_error_line(["linear", "--resume", str(run_dir)], subprocess_too=False, cwd=tmp_path,
                              monkeypatch=monkeypatch, capsys=capsys)
    finally:
        (run_dir / "config.json").write_text(json.dumps(written))
    assert line.startswith(f"error: {run_dir / 'config.json'}: {said}"), line
    assert line.endswith(DAMAGED) and "--epochs" not in line and "--lr" not in line, line
    assert len(KeptParts(run_dir).read()) == 1  # nothing trained, nothing written


def test_a_config_cut_short_is_named_with_the_fix(stopped, tmp_path, monkeypatch, capsys):
    run_dir, written = stopped
    text = json.dumps(written)
    (run_dir / "config.json").write_text(text[: len(text) // 2])
    try:
        line = one_error_line(["linear", "--resume", str(run_dir)], subprocess_too=False, cwd=tmp_path,
                              monkeypatch=monkeypatch, capsys=capsys)
    finally:
        (run_dir / "config.json").write_text(text)
    assert line.startswith(f"error: {run_dir / 'config.json'} is not valid JSON ("), line
    assert line.endswith("the run's record was cut short or damaged, so the run cannot go on: start a new run"), line


@pytest.mark.parametrize("key, value, said", [("epochs", -1, "epochs -1: use at least 1"),
                                              ("lrs", ["abc"], "lrs 'abc': use a number"),
                                              ("decode", "jpeg", "decode jpeg: use gpu")])
def test_a_finetune_config_edited_is_blamed_on_the_file_too(tmp_path, monkeypatch, capsys, key, value, said):
    taken = FinetuneOptions(init="best", loss="an", dataset="voc", cache=Path("/c.h5"), from_run=Path("/r"),
                            weights="none", resolution=32, epochs=1, lrs=[1e-3], batch_sizes=[8], seeds=1,
                            head_lr_mult=1.0, skip_missing=False, hparams={}, fidelity="exact", decode="cpu")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    facts = {"stage": "finetune", "root": "data", "cache_id": "x", "device": "cpu"}
    for config, where in (({**facts, **taken.stored(), key: value}, ""),  # each setting once
                          ({**facts, "options": {**taken.stored(), key: value}}, "options.")):  # the shape before
        (run_dir / "config.json").write_text(json.dumps(config))
        line = one_error_line(["finetune", "--resume", str(run_dir), "--device", "cpu"], subprocess_too=False,
                              cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
        assert line.startswith(f"error: {run_dir / 'config.json'}: {where}{said}") and line.endswith(DAMAGED), line


def test_a_value_given_by_a_caller_is_still_its_flags():
    """The same declarations check a value a caller gives: its line names the flag, as before."""
    with pytest.raises(SpmlError, match=r"^--epochs -1: use at least 1$"):
        LinearOptions.from_stored({"epochs": -1})
    with pytest.raises(SpmlError, match=r"^--lr 'abc': use a number$"):
        LinearOptions(lrs=["abc"])
    with pytest.raises(SpmlError, match=r"^x/config.json: epochs -1: use at least 1 \(the run's record"):
        LinearOptions.from_stored({"epochs": -1}, Path("x/config.json"))
