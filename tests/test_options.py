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
from spml_cache.runtime.errors import SpmlError

STAGES = {"extract": (ExtractOptions, ExtractPlacement), "linear": (LinearOptions, LinearPlacement),
          "finetune": (FinetuneOptions, FinetunePlacement)}


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
            if option.flag == "":  # Python only
                continue
            panel = panels["Arguments" if option.argument else "Options" if option.results else PLACEMENT_PANEL]
            name = option.name if option.argument else option.cli_flag
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
