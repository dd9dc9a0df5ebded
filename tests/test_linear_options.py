"""Stage two's options: one `LinearOptions` (each option's default and check declared once) and one
`LinearPlacement`, built alike by the command line and by `run_linear`'s keywords."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from cli_support import run_main

import spml_cache.linear
from spml_cache.linear import LinearOptions, LinearPlacement, run as linear_run
from spml_cache.observation import parse_rules
from spml_cache.protocol import GRID_BATCH_SIZES, GRID_LRS, LINEAR_EPOCHS
from spml_cache.runtime.errors import SpmlError


def test_an_option_not_given_is_none_and_takes_the_protocols_default():
    options = LinearOptions(epochs=3)
    assert options.epochs == 3 and options.lrs is None and options.given()["lrs"] is None  # --resume tells them apart
    assert options.value("epochs") == 3
    assert (list(options.value("lrs")), list(options.value("batch_sizes"))) == (list(GRID_LRS), list(GRID_BATCH_SIZES))
    assert (LinearOptions().value("epochs"), LinearOptions().value("seeds"), LinearOptions().value("losses"),
            LinearOptions().value("val_labels")) == (LINEAR_EPOCHS, 1, "all", "clean")


@pytest.mark.parametrize("rows", [0, -3, 2.5, True])
def test_a_bad_chunk_rows_is_refused_by_the_options_themselves(rows):
    with pytest.raises(SpmlError, match=rf"^--chunk-rows {rows}: give a whole number of rows, at least 1$"):
        LinearOptions(chunk_rows=rows)


def test_a_memory_budget_is_read_once_as_bytes():
    assert LinearOptions(memory_budget="2MB").memory_budget == 2 * 1024 * 1024
    with pytest.raises(SpmlError, match="--memory-budget"):
        LinearOptions(memory_budget="lots")


def test_the_keyword_form_splits_its_keywords_between_the_two_types(monkeypatch):
    seen = {}
    monkeypatch.setattr(linear_run, "_run_linear", lambda options, placement: seen.update(
        options=options, placement=placement))
    given = dict(cache=Path("c.h5"), losses=["an"], lrs=[1e-2], seeds=2, memory_budget=1024, resume=Path("r"),
                 device="cpu", out=Path("o"), workers=3, graphs=False, compile_steps=True, cache_dir=Path("caches"),
                 trackers=("tensorboard",))
    placement = {"device", "out", "workers", "graphs", "compile_steps", "cache_dir", "console", "resume", "trackers"}
    assert {f.name for f in fields(LinearPlacement)} == placement | {"config", "run_dir_made"}
    assert not placement & {f.name for f in fields(LinearOptions)}  # no keyword is both
    spml_cache.linear.run_linear(**given)
    for key, value in given.items():
        assert getattr(seen["placement" if key in placement else "options"], key) == value, key
    with pytest.raises(TypeError, match="lr"):
        spml_cache.linear.run_linear(lr=[1e-2])  # a misspelt option is not ignored


def test_the_command_line_builds_the_options_the_python_api_would(tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(spml_cache.linear, "run_linear", lambda options, placement: seen.update(
        options=options, placement=placement))
    code, err = run_main("linear", "--cache", "c.h5", "--loss", "an,role", "--lr", "0.1,0.01", "--wd", "0,1e-4",
                         "--epochs", "2", "--hp", "delta=0.1", "--observe", "single,entry:0.1", "--memory-budget",
                         "1MB", "--device", "cpu", "--workers", "2", "--no-graphs", "--compile", cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    assert seen["options"] == LinearOptions(cache=Path("c.h5"), losses=["an", "role"], lrs=[0.1, 0.01],
                                            wds=[0.0, 1e-4], epochs=2, hparams={"delta": 0.1},
                                            observe=parse_rules("single,entry:0.1"), memory_budget=2**20)
    assert seen["placement"] == LinearPlacement(device="cpu", out=None, workers=2, graphs=False,
                                                compile_steps=True)  # out None: runs/
