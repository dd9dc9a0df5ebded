"""Stage three's door and its parts (issue 34): the typed options in, a keyword form for the Python API, no
function in finetune/ with more than 8 parameters, and torchrun's state read in one place for every stage."""

from __future__ import annotations

import ast
import socket
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cli_support import REPO
from spml_cache import finetune
from spml_cache.finetune import FinetuneOptions, FinetunePlacement, parallel
from spml_cache.runtime import ranks

PACKAGE = REPO / "spml_cache"


def functions(folder: Path):
    """(file, name, parameter count, line count) of every function defined under `folder`."""
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
                yield path.relative_to(PACKAGE), node.name, count, node.end_lineno - node.lineno + 1


def test_no_function_in_finetune_takes_more_than_8_parameters_or_60_lines():
    found = list(functions(PACKAGE / "finetune"))
    assert any(name == "run_finetune" for _, name, _, _ in found)  # the scan sees the door
    assert [(str(path), name, count) for path, name, count, _ in found if count > 8] == []
    assert [(str(path), name, lines) for path, name, _, lines in found if lines > 60] == []


def test_torchrun_environment_is_read_and_the_group_joined_in_one_module():
    """WORLD_SIZE, LOCAL_RANK and the process group's start and end appear in runtime/ranks.py only."""
    markers = ("WORLD_SIZE", "LOCAL_RANK", "init_process_group", "destroy_process_group")
    readers = sorted({str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                      for marker in markers if marker in path.read_text()})
    assert readers == ["runtime/ranks.py"]


def test_the_keyword_form_splits_its_keywords_between_the_two_option_types(monkeypatch):
    seen = {}
    monkeypatch.setattr(finetune.run, "run_finetune", lambda options, run: seen.update(options=options, run=run))
    given = dict(init="best", from_run=Path("r"), cache=Path("c.h5"), dataset="voc", loss="an", weights="none",
                 resolution=64, epochs=3, lrs=(1e-4, 1e-5), batch_sizes=[4], seeds=2, head_lr_mult=10.0,
                 skip_missing=True, hparams={"ls_coef": 0.1}, fidelity="authors", decode="cpu", device="cpu", out="o",
                 resume=Path("x"), workers=0, root="data", cache_dir="caches", trackers=("mlflow",))
    placement = {"device", "out", "resume", "workers", "root", "cache_dir", "log", "trackers"}
    # every field of either type is a keyword (but `log` and `run_dir_made`, callables; `config`: test_reruns), and
    # no keyword is both
    assert set(given) | {"log", "run_dir_made", "config"} == (
        {f.name for f in fields(FinetuneOptions)} | {f.name for f in fields(FinetunePlacement)})
    assert {f.name for f in fields(FinetunePlacement)} == placement | {"config", "run_dir_made"}
    finetune.finetune(**given)
    for key, value in given.items():
        held = getattr(seen["run"] if key in placement else seen["options"], key)
        if key in ("lrs", "batch_sizes"):
            assert held == list(value)  # any sequence, held as the list a resumed run's settings compare with
        elif key in ("out", "root", "cache_dir"):
            assert held == Path(value)
        else:
            assert held == value, key
    with pytest.raises(TypeError, match="cache_path"):
        finetune.finetune(cache_path="c.h5")


def test_a_tuple_of_rates_is_no_difference_from_a_stored_list():
    options = FinetuneOptions(lrs=(1e-4,), batch_sizes=(4, 8))
    assert (options.lrs, options.batch_sizes) == ([1e-4], [4, 8])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_process_group_the_caller_joined_is_used_and_left_to_it(monkeypatch):
    """Under torchrun's environment, a group the caller already joined is the one every stage uses, and leaving
    (extract and linear: `Ranks.leave`; finetune: `stop_processes`) keeps it for the caller."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        joined = ranks.current()
        assert (joined.rank, joined.world, joined.owns_group) == (0, 1, False)
        joined.leave()
        assert dist.is_initialized()
        processes = parallel.start_processes("cpu")
        assert processes.ranks == joined and str(processes.device) == "cpu"
        parallel.stop_processes(processes)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_a_process_alone_has_no_ranks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    processes = parallel.start_processes("cpu")
    assert ranks.current() is None and processes.ranks is None
    assert (processes.rank, processes.world, processes.main) == (0, 1, True)


def test_over_nccl_each_process_takes_its_own_gpu_before_joining(monkeypatch):
    """What a GPU run under torchrun does first (checked on the CPU, the GPU calls recorded): the local rank's GPU
    is made current, then the group is joined over nccl, and the process's device is that GPU."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.append(("join", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    joined = ranks.current("nccl")
    # the join runs in a thread of its own (ranks._join: a stop is taken meanwhile), whose current device is its own
    assert calls == [("set_device", 1), ("set_device", 1), ("join", "nccl")]
    assert joined.device(torch.device("cuda")) == torch.device("cuda", 1) and joined.owns_group
