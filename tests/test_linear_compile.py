"""`linear --compile` (linear/compiled.py): each stack's step compiled by torch.compile where the run pays it back.

The suite does not pay inductor's compile (seconds a graph, docs/benchmarks.md): SPML_COMPILE_BACKEND names
aot_eager, which traces the step as inductor does (dynamo, then AOT autograd's functionalised, decomposed graph)
and runs that graph's ops eagerly. What it checks is the plumbing: what is compiled and when, guards that hold
from step to step (no recompile), the last partial batch left eager, the loss without a closed form left
eager, the line printed, and results within float rounding of an eager run."""

import io
import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo.utils
from rich.console import Console

from cli_support import REPO, run_cli
from linear_support import quiet, reordering_step, write_synthetic_cache
from spml_cache.linear import compiled, run_linear
from spml_cache.runtime.errors import SpmlError

VAL_ROWS, CLASSES = 24, 4
# 60 training rows: batch 8 is 7 full steps and a partial one of 4 rows, batch 16 three and one of 12
GRID = dict(lrs=[1e-2, 1e-3], batch_sizes=[8, 16], epochs=3, workers=1, device="cpu")


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=60, val=VAL_ROWS,
                                 test=24, classes=CLASSES, dim=8)


def test_a_compiled_run_selects_the_heads_an_eager_run_does(tmp_path, tiny_cache, monkeypatch):
    """Every closed-form loss's stacks compiled (one graph per batch size, never recompiled as the steps and
    epochs go on), opml_sp's (autograd) left eager, one line per compiled loss; and every head's val mAP within
    1e-6 points of the eager run's, below the 5e-3 a reordering of two val scores makes on 24 rows of 4 classes
    (linear_support.reordering_step): the same rankings, best epochs and selection. The compiled graph rounds
    otherwise than the eager ops (decomposed, fused): float32 rounding apart, as a stack of other shape is."""
    assert 1e-6 < reordering_step(VAL_ROWS, CLASSES)
    monkeypatch.setenv(compiled.BACKEND_VARIABLE, "aot_eager")
    names = ["an", "role", "l2r", "opml_sp"]
    eager = run_linear(cache=tiny_cache, losses=names, out=tmp_path / "eager", console=quiet(), **GRID)
    printed, graphs = io.StringIO(), torch._dynamo.utils.counters["stats"]["unique_graphs"]
    run = run_linear(cache=tiny_cache, losses=names, out=tmp_path / "compiled", compile_steps=True,
                     console=Console(file=printed, width=400), **GRID)
    lines = [line for line in printed.getvalue().splitlines() if "compiled" in line]
    assert [line.split(" step in ")[0] for line in lines] == [f"compiled the {name}" for name in names[:-1]]
    assert all(line.endswith(" s (2 graphs)") for line in lines), lines
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2 * 3  # compiled once each
    for name in names:
        mine, theirs = run.results["losses"][name], eager.results["losses"][name]
        assert mine["selected"] == theirs["selected"] and mine["best_epoch"] == theirs["best_epoch"]
        for a, b in zip(mine["configs"], theirs["configs"], strict=True):
            assert (a["lr"], a["batch_size"], a["best_epoch"]) == (b["lr"], b["batch_size"], b["best_epoch"])
            assert a["val_map"] == pytest.approx(b["val_map"], abs=1e-6)


def test_compile_leaves_a_run_too_short_to_pay_it_back_eager_and_says_so(tmp_path, tiny_cache, monkeypatch):
    monkeypatch.delenv(compiled.BACKEND_VARIABLE, raising=False)  # inductor's threshold (nothing is compiled)
    printed = io.StringIO()
    run_linear(cache=tiny_cache, losses="an", out=tmp_path, compile_steps=True, console=Console(file=printed,
                                                                                                  width=400), **GRID)
    lines = [line for line in printed.getvalue().splitlines() if "compile" in line]
    assert lines == ["--compile: no step compiled: the most full steps a stack takes is 21 (3 epochs of batch 8),"
                     f" fewer than the {compiled.MIN_STEPS:,} that pay a compile back"]


def test_compile_beside_cuda_graphs_is_refused_in_one_line(tmp_path, tiny_cache, monkeypatch):
    monkeypatch.setattr("spml_cache.linear.run.resolve_device", lambda device: torch.device("cuda"))
    with pytest.raises(SpmlError) as refused:
        run_linear(cache=tiny_cache, losses="an", out=tmp_path, compile_steps=True, device="cuda", console=quiet())
    assert str(refused.value) == ("--compile: on a GPU stage two replays each step as a CUDA graph, which a compiled"
                                  " step cannot be captured into; leave out --compile, or add --no-graphs to compile"
                                  " eager steps")
    assert not (tmp_path / "voc").exists()  # refused before anything is written


def test_the_command_line_compiles_with_compile_and_prints_the_time_once(tmp_path, tiny_cache):
    done = run_cli("linear", "--cache", str(tiny_cache), "--loss", "an", "--epochs", "1", "--lr", "0.01",
                   "--batch-size", "8,16", "--compile", "--workers", "1", "--out", str(tmp_path), cwd=tmp_path,
                   env={compiled.BACKEND_VARIABLE: "eager"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "compiled" in line]  # with the run's other notes
    assert len(lines) == 1 and lines[0].startswith("compiled the an step in ") and lines[0].endswith(" s (2 graphs)")


def test_an_unknown_backend_in_the_variable_is_one_line_naming_it(tmp_path, tiny_cache):
    """SPML_COMPILE_BACKEND=bogus failed the run's first loss in its worker: "a bug in spml-cache's an: please report
    it" (issue 56). It is the variable's fault, said before anything is written."""
    done = run_cli("linear", "--cache", str(tiny_cache), "--loss", "an", "--compile", "--epochs", "1",
                   cwd=tmp_path, env={compiled.BACKEND_VARIABLE: "aot_eagr"})
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1 and line == (
        "error: SPML_COMPILE_BACKEND=aot_eagr: unknown torch.compile backend 'aot_eagr' (did you mean aot_eager?);"
        " unset it for inductor, the default, or name one of torch._dynamo.list_backends(exclude_tags=()) (aot_eager"
        " checks a compiled run without generating code)"), line
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is a machine's without a GPU")
def test_inductor_on_a_cpu_machine_with_a_cuda_toolkit_prints_nothing_of_cuda(tmp_path, tiny_cache):
    """Inductor's build imports torch's extension helper, which warned "No CUDA runtime is found, using CUDA_HOME=..."
    as the first line of a --compile run on a CPU machine with a CUDA toolkit (issue 56). A subprocess whose
    MIN_STEPS is 1, so that inductor compiles this tiny run's steps; CUDA_HOME names a toolkit, as an installed
    one would be found."""
    code = ("import sys, spml_cache.linear.compiled as compiled; compiled.MIN_STEPS = 1; sys.argv[0] = 'spml-cache';"
            " from spml_cache.cli import main; main()")
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400", CUDA_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code, "linear", "--cache", str(tiny_cache), "--loss", "an",
                           "--compile", "--epochs", "1", "--lr", "1e-2", "--batch-size", "8"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "CUDA" not in done.stderr + done.stdout, done.stderr
    assert done.stderr.splitlines()[0].startswith("compiled the an step in "), done.stderr
