"""Two run directories compared as results: their results.json's numbers (less the wall times) and their best.pt's
tensors, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TIMES = ("seconds",)  # what two runs of the same settings differ by


def results_less_times(value):
    """results.json's content without its wall times, at any depth."""
    if isinstance(value, dict):
        return {key: results_less_times(one) for key, one in value.items() if key not in TIMES}
    if isinstance(value, list):
        return [results_less_times(one) for one in value]
    return value


def assert_same_tensors(mine, theirs, where: str = "best.pt") -> None:
    """Every tensor of `mine` equal to `theirs`' bit for bit (torch.equal), everything else equal."""
    if isinstance(theirs, dict):
        assert isinstance(mine, dict) and mine.keys() == theirs.keys(), where
        for key in theirs:
            assert_same_tensors(mine[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(mine, torch.Tensor) and mine.dtype == theirs.dtype and torch.equal(mine, theirs), where
    else:
        assert mine == theirs, where


def assert_same_run(mine: Path, theirs: Path, cwd: Path | None = None) -> None:
    """The same results (results.json less its times) and the same best models (best.pt), bit for bit. A
    fine-tuning's linear run (`init.run`) is the same run as a path relative to `cwd` (where a run found it) or
    absolute (where a record named it)."""
    def read(run: Path) -> dict:
        results = results_less_times(json.loads((Path(run) / "results.json").read_text()))
        if cwd is not None and (results.get("init") or {}).get("run"):
            results["init"]["run"] = str((Path(cwd) / results["init"]["run"]).resolve())
        return results

    assert read(mine) == read(theirs)
    load = lambda run: torch.load(Path(run) / "best.pt", weights_only=True)  # noqa: E731
    assert_same_tensors(load(mine), load(theirs))
