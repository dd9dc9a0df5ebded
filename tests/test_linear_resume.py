"""An interrupted `linear` keeps every finished (loss, seed, batch size) and `--resume RUN` gives the uninterrupted
run's results; Ctrl-C says in one line what was kept and the command that goes on."""

import json
import os
import shutil
import signal

import h5py
import pytest
import torch
from cli_support import ended, run_cli, start_cli
from linear_support import interrupted_run, quiet, write_synthetic_cache

from spml_cache.linear import LinearOptions, run_linear
from spml_cache.linear.parts import KeptParts
from spml_cache.runtime.errors import Interrupted, SpmlError

GRID = dict(losses=["an", "role"], lrs=[1e-2, 1e-3], batch_sizes=[4, 8], epochs=2, seeds=2)



@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=40, val=16, test=20)


def without_seconds(results: dict) -> dict:
    return {name: {k: v for k, v in entry.items() if k != "seconds"} for name, entry in results["losses"].items()}


def sorted_metrics(run_dir):
    return sorted((run_dir / "metrics.jsonl").read_text().splitlines())


def test_resume_gives_the_uninterrupted_run(tmp_path, tiny_cache, monkeypatch):
    whole = run_linear(cache=tiny_cache, out=tmp_path / "whole", console=quiet(), **GRID)
    kept = KeptParts.keep
    calls = []

    def stopped_after_three(*args):
        kept(*args)
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(KeptParts, "keep", stopped_after_three)
    with pytest.raises(Interrupted) as stopped:
        run_linear(cache=tiny_cache, out=tmp_path / "cut", console=quiet(), **GRID)
    monkeypatch.setattr(KeptParts, "keep", kept)
    (run_dir,) = (tmp_path / "cut" / "voc").iterdir()
    assert stopped.value.kept == f"3 of 8 (loss, seed, batch size) parts are kept in {run_dir}"
    assert stopped.value.command == f"spml-cache linear --resume {run_dir}"
    assert not (run_dir / "results.json").exists() and len(list((run_dir / "jobs").glob("*.pt"))) == 3

    # Another process layout on resume (two worker processes): the parts are independent, so nothing changes.
    resumed = run_linear(resume=run_dir, workers=2, console=quiet())
    assert resumed.run_dir == run_dir and not (run_dir / "jobs").exists()
    assert without_seconds(resumed.results) == without_seconds(whole.results)
    first, second = (torch.load(r.run_dir / "best.pt", weights_only=True) for r in (whole, resumed))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert sorted_metrics(run_dir) == sorted_metrics(whole.run_dir)
    with pytest.raises(SpmlError, match="already complete"):
        run_linear(resume=run_dir, console=quiet())


def test_resume_says_once_what_was_kept_and_what_it_trains_and_reprints_no_done(tmp_path, tiny_cache, monkeypatch):
    """A loss whose every part the stopped run kept is said as kept (trained before), not as done now; the count
    of kept and trained parts comes once, first."""
    run_dir = interrupted_run(tmp_path / "cut", tiny_cache, monkeypatch, 5, **GRID)
    kept = KeptParts(run_dir).read()
    whole = [key for key in GRID["losses"] if sum(part[0] == key for part in kept) == 4]  # 2 seeds x 2 batch sizes
    assert len(kept) == 5 and len(whole) == 1  # one loss kept whole, one part of the other
    done = run_cli("linear", "--resume", str(run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()  # the progress lines (stdout holds the summary table)
    said = [line for line in lines if "parts kept" in line]
    assert said == [f"resuming {run_dir}: 5 of 8 (loss, seed, batch size) parts kept, training 3"]
    assert lines.index(said[0]) < min(i for i, line in enumerate(lines) if line.startswith(tuple(GRID["losses"])))
    (reused,) = [line for line in lines if line.startswith(f"{whole[0]}: ")]
    assert reused.startswith(f"{whole[0]}: kept, trained before in ") and "done" not in reused
    (other,) = [name for name in GRID["losses"] if name not in whole]
    assert any(line.startswith(f"{other}: done, ") for line in lines)


def test_resume_refuses_what_is_not_an_interrupted_linear_run(tmp_path):
    with pytest.raises(SpmlError, match="not a run directory"):
        run_linear(resume=tmp_path, console=quiet())
    (tmp_path / "config.json").write_text(json.dumps({"stage": "finetune"}))
    with pytest.raises(SpmlError, match="resume it with spml-cache finetune"):
        run_linear(resume=tmp_path, console=quiet())


def test_ctrl_c_on_the_command_line_says_what_was_kept_and_goes_on(tmp_path):
    """SIGINT to the whole process group, as a terminal sends it: the worker processes stay quiet, the command
    exits 130 with one line, and the command it names finishes the run."""
    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=1500, val=20, test=20)
    args = ["--cache", str(cache_path), "--loss", "an,role", "--seeds", "3", "--lr", "1e-2", "--batch-size", "4,8",
            "--epochs", "3", "--workers", "2"]
    process = start_cli("linear", *args, cwd=tmp_path,  # ready: the first of 12 parts, each seconds long, kept
                        ready=lambda: list(tmp_path.glob("runs/voc/*/jobs/*.pt")))
    os.killpg(process.pid, signal.SIGINT)
    stderr = ended(process, tmp_path)
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert process.returncode == 130, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and lines[-1].startswith("interrupted: ")
    assert lines[-1].endswith(f"parts are kept in runs/voc/{run_dir.name}; go on with: spml-cache linear --resume "
                              f"runs/voc/{run_dir.name}")
    assert not (run_dir / "results.json").exists()
    done = run_cli("linear", "--resume", f"runs/voc/{run_dir.name}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert set(json.loads((run_dir / "results.json").read_text())["losses"]) == {"an", "role"}


def test_resume_refuses_a_cache_whose_contents_changed(tmp_path, tiny_cache, monkeypatch):
    """Edited in place, or another cache of the same settings copied over it: the attrs alone are the same."""
    cache_path = tmp_path / tiny_cache.name
    shutil.copy(tiny_cache, cache_path)
    grid = {**GRID, "seeds": 1}
    run_dir = interrupted_run(tmp_path / "cut", cache_path, monkeypatch, parts=1, **grid)
    with h5py.File(cache_path, "r+") as file:
        file["train"]["features"][0, 0] += 1.0
    with pytest.raises(SpmlError, match=f"{cache_path} was changed after it was written"):
        run_linear(resume=run_dir, console=quiet())
    write_synthetic_cache(cache_path, train=40, val=16, test=20, seed=1)  # the same attrs, other features
    with pytest.raises(SpmlError, match="was rebuilt since that run began"):
        run_linear(resume=run_dir, console=quiet())
    shutil.copy(tiny_cache, cache_path)  # the original back: the run goes on
    assert run_linear(resume=run_dir, console=quiet()).results["complete"]


# Each flag beside --resume with a value the run was not started with (the run: an,role, lrs 1e-2,1e-3, batch
# sizes 4,8, 2 epochs, 2 seeds, single, clean, exact, 200KB), and the setting the refusal names.
CONTRADICTING = [
    (["--loss", "an"], "--loss an", "an,role"), (["--lr", "1e-3"], "--lr 0.001", "0.01,0.001"),
    (["--batch-size", "4,8,16"], "--batch-size 4,8,16", "4,8"), (["--epochs", "3"], "--epochs 3", "2"),
    (["--seeds", "1"], "--seeds 1", "2"), (["--observe", "entry:0.5"], "--observe entry:0.5", "single"),
    (["--val-labels", "observed"], "--val-labels observed", "clean"),
    (["--fidelity", "authors"], "--fidelity authors", "exact"),
    (["--hp", "role.lr_mult=5"], "--hp role.lr_mult=5", "10"),
    (["--memory-budget", "1GB"], "--memory-budget 1GB", "200KB"),
    (["--chunk-rows", "16"], "--chunk-rows 16", "40"),  # 200KB: the train rows stream, one chunk of all 40
    (["--wd", "0,1e-4"], "--wd 0,0.0001", "0"),  # a run without the weight decay axis: 0 alone
]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tiny_cache):
    """A run of GRID under a 200KB budget, stopped after its first part (in its own module-scoped folder)."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        return interrupted_run(tmp_path_factory.mktemp("stopped"), tiny_cache, monkeypatch, 1, memory_budget="200KB",
                               **GRID)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("flags, given, theirs", CONTRADICTING)
def test_resume_refuses_a_flag_that_contradicts_the_run_in_one_line(tmp_path, stopped_run, monkeypatch, capsys,
                                                                     flags, given, theirs):
    from cli_support import run_main

    code, err = run_main("linear", "--resume", str(stopped_run), *flags, cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, err
    assert f"{given} contradicts the run's {theirs}" in lines[0] and f"leave out {flags[0]}" in lines[0], lines[0]
    assert str(stopped_run) in lines[0]
    assert len(KeptParts(stopped_run).read()) == 1  # nothing trained, nothing written


def test_resume_refuses_another_cache(tmp_path, stopped_run, monkeypatch, capsys):
    from cli_support import run_main

    other = write_synthetic_cache(tmp_path / "other.h5", train=40, val=16, test=20, seed=1)
    code, err = run_main("linear", "--resume", str(stopped_run), "--cache", str(other), cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "--cache" in err and "leave out --cache" in err, err


def test_resume_takes_the_stored_budget_and_accepts_flags_that_agree(tmp_path, tiny_cache, monkeypatch):
    """The budget is kept in config.json and a resume plans with it, not with the memory free now; flags that
    repeat the run's own settings are accepted."""
    from spml_cache.linear import run as linear_run

    whole = run_linear(cache=tiny_cache, out=tmp_path / "whole", console=quiet(), memory_budget="200KB", **GRID)
    run_dir = interrupted_run(tmp_path / "cut", tiny_cache, monkeypatch, 3, memory_budget="200KB", **GRID)
    assert json.loads((run_dir / "config.json").read_text())["memory_budget"] == 200 * 2**10
    budgets, load_within = [], linear_run.load_within
    monkeypatch.setattr(linear_run, "load_within", lambda path, budget, *rest: budgets.append(budget)
                        or load_within(path, budget, *rest))
    agreeing = dict(losses=["an", "role"], lrs=[0.01, 0.001], epochs=2, seeds=2, memory_budget="200KB", wds=[0])
    resumed = run_linear(resume=run_dir, console=quiet(), **agreeing)
    assert budgets == [200 * 2**10]
    assert without_seconds(resumed.results) == without_seconds(whole.results)


GRID_KEYS = ("losses", "lrs", "batch_sizes", "epochs", "hparams", "val_labels", "fidelity", "cache", "dataset")


def older_config(config: dict, shape: str) -> dict:
    """A run's config.json as spml-cache wrote it before each setting was kept once: `options` (every option under
    `options`, the grid beside it again with its seeds as a list) or, older, `grid` (the grid and the stage's
    extras alone: no `options`, the memory plan under `out_of_core`, nothing for single alone or no weight decay)."""
    options = {name: config.pop(name) for name in LinearOptions.declared() if name in config}
    grid = {**{key: options[key] for key in GRID_KEYS}, "seeds": list(range(options["seeds"]))}
    if shape == "options":
        return {**config, **grid, "options": options}
    return {**config, **grid, "memory_budget": options["memory_budget"],
            "out_of_core": {"chunk_rows": options["chunk_rows"]}}


@pytest.mark.parametrize("shape", ["options", "grid"])
def test_a_run_from_before_each_setting_was_kept_once_still_resumes(tmp_path, tiny_cache, monkeypatch, shape):
    """A config.json of either older shape: a resume reads its settings back, refuses a flag that contradicts
    them, and gives the uninterrupted run's results."""
    whole = run_linear(cache=tiny_cache, out=tmp_path / "whole", console=quiet(), memory_budget="200KB", **GRID)
    run_dir = interrupted_run(tmp_path / "cut", tiny_cache, monkeypatch, 1, memory_budget="200KB", **GRID)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["chunk_rows"] == 40 and config["observe"] == ["single"] and config["wds"] == [0.0]
    assert "options" not in config and config["seeds"] == 2  # each setting once, under its own name
    (run_dir / "config.json").write_text(json.dumps(older_config(config, shape)))
    for given, said in ((dict(epochs=3), "--epochs 3 contradicts the run's 2"),
                        (dict(chunk_rows=16), "--chunk-rows 16 contradicts the run's 40"),
                        (dict(wds=[0, 1e-4]), "--wd 0,0.0001 contradicts the run's 0"),
                        (dict(seeds=1), "--seeds 1 contradicts the run's 2")):
        with pytest.raises(SpmlError, match=said):
            run_linear(resume=run_dir, console=quiet(), **given)
    resumed = run_linear(resume=run_dir, console=quiet(), lrs=[1e-2, 1e-3], memory_budget="200KB")
    assert without_seconds(resumed.results) == without_seconds(whole.results)


def test_several_contradictions_are_one_line_naming_each_flag(tmp_path, tiny_cache, monkeypatch):
    run_dir = interrupted_run(tmp_path, tiny_cache, monkeypatch, 1, **GRID)
    with pytest.raises(SpmlError) as refused:
        run_linear(resume=run_dir, console=quiet(), epochs=3, seeds=1, dataset="coco")
    assert str(refused.value) == (
        f"--resume {run_dir}: --dataset coco contradicts the run's voc; --epochs 3 contradicts the run's 2; --seeds 1"
        " contradicts the run's 2 (a resumed run keeps its own settings): leave out --dataset, --epochs and --seeds,"
        " or start a new run with them")


def test_resume_refuses_an_out_it_would_not_write_to(tmp_path, stopped_run, monkeypatch, capsys):
    """`--resume RUN --out elsewhere` went on in RUN and left --out unused without a word."""
    from cli_support import run_main

    code, err = run_main("linear", "--resume", str(stopped_run), "--out", str(tmp_path / "elsewhere"), cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    own = stopped_run.resolve().parent.parent
    assert code == 1 and err.strip().splitlines() == [
        f"error: --out {tmp_path / 'elsewhere'}: --resume {stopped_run} goes on in its own run directory, under {own};"
        " leave out --out (a new run in another folder: leave out --resume)"], err
    assert len(KeptParts(stopped_run).read()) == 1 and not (tmp_path / "elsewhere").exists()
