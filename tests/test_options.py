"""Each option declared once (options/): the command line's flags and help come from the declarations, a bad value
is refused in one line naming its flag and the fix, config.json keeps the options whole and reads them back, and
`--resume` compares the options given with a run's own by one rule in every stage."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spml_cache.cli import app
from spml_cache.cli.declared import PLACEMENT_PANEL
from spml_cache.observation import parse_rules
from spml_cache.options import (
    ExtractOptions, ExtractPlacement, FinetuneOptions, FinetunePlacement, LinearOptions, LinearPlacement,
    refuse_differences,
)
from spml_cache.options.demo import DemoPlacement, DemoSizes
from spml_cache.options.report import ReportOptions
from spml_cache.runtime.errors import SpmlError

STAGES = {"extract": (ExtractOptions, ExtractPlacement), "linear": (LinearOptions, LinearPlacement),
          "finetune": (FinetuneOptions, FinetunePlacement), "report": (ReportOptions,),
          "demo": (DemoSizes, DemoPlacement)}


def help_panels(command: str) -> dict[str, str]:
    """The command's `--help` as printed (400 columns), cut into its panels: {title: text}."""
    done = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    assert done.exit_code == 0, done.output
    panels, title = {}, None
    for line in done.output.splitlines():
        opened = re.match(r"╭─ (.*?) ─", line)
        if opened:
            title = opened.group(1)
        elif title is not None:
            panels[title] = panels.get(title, "") + " " + " ".join(line.strip("│ ").split())
    return panels


@pytest.mark.parametrize("command", list(STAGES))
def test_every_declared_flag_is_in_its_commands_help_with_its_help_in_its_panel(command):
    panels = help_panels(command)
    for kind in STAGES[command]:
        for option in kind.declared().values():
            if option.flag == "" or option.hidden:  # Python only, or left out of --help (the demo's sizes)
                assert option.flag == "" or option.cli_flag not in " ".join(panels.values()), (command, option.name)
                continue
            panel = panels["Arguments" if option.argument else "Options" if option.results else PLACEMENT_PANEL]
            name = option.name if option.argument else option.cli_flag
            panel = panels["Arguments"] if option.argument else panel
            assert name in panel, (command, name)
            assert " ".join(option.help.split())[:60] in panel, (command, name)


def test_a_default_is_written_once_and_shown_from_its_declaration():
    options = help_panels("extract")["Options"]
    assert "Images per forward pass. [default: 64]" in help_panels("extract")[PLACEMENT_PANEL]
    assert ExtractPlacement().batch_size == 64 and "[default: pooled]" in options and "[default: auto]" in options


@pytest.mark.parametrize("build, line", [
    (lambda: ExtractPlacement(batch_size=0), "--batch-size 0: use at least 1"),
    (lambda: ExtractPlacement(workers=-1), "--workers -1: use 0 (load in the main process) or more"),
    (lambda: ExtractOptions(dataset="voc", precision="fp8"), "--precision 'fp8': use auto, fp32, fp16 or bf16"),
    (lambda: ExtractOptions(dataset="voc", resolution=16), "--resolution 16: use a side between 32 and 2048 pixels"
                                                            " (the papers use 448)"),
    (lambda: LinearOptions(epochs=0), "--epochs 0: use at least 1"),
    (lambda: LinearOptions(seeds=0), "--seeds 0: use at least 1 (seeds 0..N-1 are run)"),
    (lambda: LinearOptions(val_labels="noisy"), "--val-labels 'noisy': use clean (full val labels) or observed"),
    (lambda: LinearOptions(lrs="1e-3,fast"), "--lr '1e-3,fast': expected a comma list of numbers"),
    (lambda: LinearOptions(fidelity="nearly"), "--fidelity 'nearly': use exact or authors (docs/fidelity.md)"),
    (lambda: FinetuneOptions(head_lr_mult=0), "--head-lr-mult 0: must be positive"),
    (lambda: FinetuneOptions(init="random"), "--init 'random': use best (LinearInit) or imagenet (a fresh head)"),
    (lambda: FinetuneOptions(resolution=8), "--resolution 8: use at least 32"),
    (lambda: FinetuneOptions(epochs=2.5), "--epochs 2.5: use a whole number"),
    (lambda: LinearOptions(chunk_rows=True), "--chunk-rows True: give a whole number of rows, at least 1"),
    (lambda: LinearOptions(lrs=[]), "--lr is empty: give at least one value, e.g. --lr 1e-3"),
    (lambda: LinearOptions(lrs="0.1,-1"), "--lr 0.1,-1: every value must be positive"),
    (lambda: LinearOptions(wds="nan"), "--wd nan: every weight decay must be 0 or more (0: none)"),
    (lambda: FinetuneOptions(batch_sizes=[8, 0]), "--batch-size 8,0: every value must be positive and whole"),
    (lambda: FinetuneOptions(lrs=["abc"]), "--lr 'abc': use a number"),
    (lambda: DemoSizes(batch_sizes=()), "--batch-size is empty: give at least one value, e.g. --batch-size 8"),
    (lambda: ExtractOptions(dataset="voc", decode="jpeg"), "--decode jpeg: use gpu (nvjpeg, on a CUDA device) or"
                                                           " cpu (libjpeg-turbo in the loader workers: the CPU's pixels)"),
    (lambda: FinetuneOptions(decode="jpeg"), "--decode jpeg: use gpu (nvjpeg, on a CUDA device) or cpu (libjpeg-turbo"
                                             " in the loader workers: the CPU's pixels)"),
    (lambda: ReportOptions(pivot="dataset"), "--pivot dataset: use backbone (rows losses, a column per backbone and"
                                             " feature kind)"),
    (lambda: ReportOptions(resamples=50), "--resamples 50: a 95% interval needs at least 100 resamples (1,000 by"
                                          " default)"),
])  # fmt: skip
def test_a_bad_value_is_one_line_naming_its_flag_and_the_fix(build, line):
    with pytest.raises(SpmlError) as refused:
        build()
    assert str(refused.value) == line


def test_text_and_python_values_build_the_same_options():
    given = LinearOptions(losses="an,role", lrs="0.1, 0.01", batch_sizes="8,16", hparams=["delta=0.1"],
                          observe="single,entry:0.1", memory_budget="1MB", fidelity="authors")
    assert given == LinearOptions(losses=["an", "role"], lrs=[0.1, 0.01], batch_sizes=(8, 16), hparams={"delta": 0.1},
                                  observe=parse_rules("single,entry:0.1"), memory_budget=2**20, fidelity="authors")
    assert FinetuneOptions(lrs="grid").lrs == [1e-2, 1e-3, 1e-4, 1e-5]


@pytest.mark.parametrize("options", [
    LinearOptions(cache=Path("/c.h5"), dataset="voc", losses=["an"], lrs=[0.1], wds=[0.0, 1e-4], batch_sizes=[8],
                  epochs=2, seeds=3, val_labels="observed", from_run=Path("/runs/r"), fidelity="authors",
                  hp_grid="paper", observe=parse_rules("single,entry:0.1"), memory_budget=2**20, chunk_rows=16),
    FinetuneOptions(init="imagenet", cache=Path("/c.h5"), dataset="voc", loss="an@entry:0.1", weights="none",
                    epochs=2, lrs=[1e-4], batch_sizes=[8], resolution=64, seeds=2, hparams={"ls_coef": 0.1},
                    head_lr_mult=10.0, skip_missing=True, fidelity="exact", decode="cpu"),
    ExtractOptions(dataset="voc", backbone="resnet18", resolution=64, observe=parse_rules("entry:0.5"), limit=3),
], ids=["linear", "finetune", "extract"])
def test_config_json_keeps_the_options_whole_and_reads_them_back(options):
    stored = json.loads(json.dumps(options.stored()))  # what config.json holds
    assert set(stored) == set(type(options).declared()) and type(options).from_stored(stored) == options
    assert options.differences(options) == []


def test_resume_compares_by_one_rule_in_every_stage():
    run = LinearOptions(losses=["an", "role"], lrs=[0.01, 0.001], epochs=2, seeds=2, cache=Path("/a/c.h5"),
                        dataset="voc", memory_budget=2**20, chunk_rows=None)
    given = LinearOptions(lrs=[0.01, 0.001], epochs=3, cache=Path("/a/../a/c.h5"), memory_budget="2MB",
                          chunk_rows=8)
    assert given.differences(run) == [("--epochs", "3", "2"), ("--memory-budget", "2MB", "1MB"),
                                      ("--chunk-rows", "8", "none")]  # the same lrs and the same file agree
    assert FinetuneOptions(epochs=3, lrs=[1e-4]).differences(FinetuneOptions(epochs=2, lrs=[1e-4])) == [
        ("--epochs", "3", "2")]
    with pytest.raises(SpmlError) as refused:
        refuse_differences("runs/x", given.differences(run))
    assert str(refused.value) == (
        "--resume runs/x: --epochs 3 contradicts the run's 2; --memory-budget 2MB contradicts the run's 1MB;"
        " --chunk-rows 8 contradicts the run's none (a resumed run keeps its own settings): leave out --epochs,"
        " --memory-budget and --chunk-rows, or start a new run with them")
    refuse_differences("runs/x", [])  # nothing given that contradicts: nothing said


def test_a_grid_value_given_twice_is_taken_once_in_the_order_given():
    assert LinearOptions(lrs="0.1,0.01,0.1").lrs == [0.1, 0.01]
    assert FinetuneOptions(batch_sizes=[16, 8, 16]).batch_sizes == [16, 8]


def test_an_option_resolves_as_its_declaration_says():
    """Given, else the source its declaration falls back on, else its default; a derived option takes its source's
    value even when given; a source naming an option that does not fall back on it is a mistake, not ignored."""
    recipe = {"epochs": 8, "lrs": [1e-5], "batch_sizes": [8], "head_lr_mult": 10.0}
    taken = FinetuneOptions(epochs=3, hparams={"ls_coef": 0.1}).resolved(
        recipe=recipe, cache={"resolution": 64, "dataset": "voc"}, losses={"hparams": {"ls_coef": 0.1, "k": 2}})
    assert (taken.epochs, taken.lrs, taken.batch_sizes, taken.head_lr_mult) == (3, [1e-5], [8], 10.0)
    assert (taken.resolution, taken.dataset, taken.hparams, taken.seeds, taken.init) == (
        64, "voc", {"ls_coef": 0.1, "k": 2}, 1, "best")
    assert taken.weights is None and taken.decode is None  # their sources were not given
    with pytest.raises(ValueError, match="no option falls back on recipe for \\['resolution'\\]"):
        FinetuneOptions().resolved(recipe={"resolution": 64})
    planned = LinearOptions(chunk_rows=8).resolved(plan={"chunk_rows": 40, "memory_budget": 2**20})
    assert (planned.chunk_rows, planned.memory_budget, planned.lrs) == (8, 2**20, [1e-2, 1e-3, 1e-4, 1e-5])


def test_the_report_command_builds_the_options_the_python_api_would(tmp_path, monkeypatch, capsys):
    from cli_support import run_main

    import spml_cache.report

    seen = []
    monkeypatch.setattr(spml_cache.report, "report_command", lambda options, console: seen.append(options))
    code, err = run_main("report", "runs/voc", "runs/coco", "--format", "md", "--ci", "--resamples", "200",
                         "--metric", "CF1@3", "--compare", "an,role", cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    assert code == 0, err
    assert seen == [ReportOptions([Path("runs/voc"), Path("runs/coco")], fmt="md", ci=True, resamples=200,
                                  metric="cf1@3", compare="an,role")]
    assert seen[0].pair == ("an", "role") and seen[0].runs_root == Path("runs") and not seen[0].paper
    code, err = run_main("report", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and seen[-1] == ReportOptions(), err  # every flag left out: the declared defaults


def test_an_option_added_to_finetune_is_its_declaration_and_its_use():
    """docs/internals.md, "Adding an option": a declared field alone gives the flag and its help, the check, the
    resolution (here from the loss's recipe), config.json's key and the --resume comparison."""
    import typer
    from dataclasses import dataclass

    from spml_cache.cli.declared import stage_command
    from spml_cache.options import at_least, given

    @dataclass(frozen=True, kw_only=True)
    class WithWarmup(FinetuneOptions):
        warmup: int | None = given(0, "Epochs of linear warm-up.", check=at_least(0), fallback="recipe")

    with pytest.raises(SpmlError, match=r"^--warmup -1: use at least 0$"):
        WithWarmup(warmup=-1)
    assert WithWarmup().resolved(recipe={"warmup": 2}).warmup == 2 and WithWarmup(warmup=1).resolved(
        recipe={"warmup": 2}).warmup == 1 and WithWarmup().resolved().warmup == 0
    taken = WithWarmup(warmup=3).resolved()
    assert taken.stored()["warmup"] == 3 and WithWarmup.from_stored(json.loads(json.dumps(taken.stored()))) == taken
    assert WithWarmup(warmup=4).differences(taken) == [("--warmup", "4", "3")]
    app, seen = typer.Typer(), []
    stage_command(app, "finetune", WithWarmup)(lambda options: seen.append(options))
    stage_command(app, "other", WithWarmup)(lambda options: None)  # a group: the command is named
    done = CliRunner().invoke(app, ["finetune", "--warmup", "5"])
    assert done.exit_code == 0, done.output
    assert seen == [WithWarmup(warmup=5)]
    assert "Epochs of linear warm-up." in CliRunner().invoke(app, ["finetune", "--help"], env={"COLUMNS": "400"}).output


def test_python_keywords_are_the_flags_names_read_and_checked_by_their_declarations():
    """The library's keyword layer (issue 53): `lr` for --lr, `batch_size` for --batch-size, `hp` for --hp,
    `from_run` for --from, `graphs` for --no-graphs; each value what the flag takes (its comma text, a list, or
    one number), a bad one named by its keyword, a misspelt keyword one line with the closest."""
    from spml_cache.options import LinearOptions, LinearPlacement, from_flag_keywords
    from spml_cache.runtime.errors import SpmlError

    options, placement = from_flag_keywords("sc.linear", {
        "loss": "an,role", "lr": "1e-3,1e-4", "batch_size": 8, "hp": ["ll_r.delta=0.001,0.002"], "from_run": "runs/x",
        "graphs": False, "compile": True}, LinearOptions, LinearPlacement)
    assert (options.losses, options.lrs, options.batch_sizes) == (["an", "role"], [1e-3, 1e-4], [8])
    assert options.hparams == {"ll_r.delta": [0.001, 0.002]} and str(options.from_run) == "runs/x"
    assert placement.graphs is False and placement.compile_steps is True
    said = {}
    for keywords in ({"batchsize": 8}, {"lr": "abc"}, {"epochs": -1}, {"batch_size": [8, 0]}):
        with pytest.raises(SpmlError) as refused:
            from_flag_keywords("sc.linear", keywords, LinearOptions, LinearPlacement)
        said[next(iter(keywords))] = str(refused.value)
    assert said["batchsize"].startswith("sc.linear: no keyword 'batchsize'; did you mean batch_size?")
    assert said["lr"] == "lr 'abc': expected a comma list of numbers"
    assert said["epochs"] == "epochs -1: use at least 1"
    assert said["batch_size"].startswith("batch_size 8,0: ")
