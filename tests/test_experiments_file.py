"""An experiment file checked in full before anything runs: one line per mistake, naming the file, the line and the
key, with the fix (did you mean, for a misspelt name); the plan each file makes, its axes' product, its caches
and runs named as the steps after them read them; the papers' recipes under examples/ print as commands whose
flags each command has."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import REPO, assert_flags_exist, one_error_line, run_cli, run_main

from spml_cache.experiments.plan import make_plan
from spml_cache.runtime.errors import SpmlError


def mistakes(tmp_path: Path, text: str, monkeypatch, capsys) -> list[str]:
    """`spml-cache run FILE --dry-run` on `text`: exit 1 and its lines, every mistake of the file."""
    (tmp_path / "bad.toml").write_text(text)
    code, stderr = run_main("run", "bad.toml", "--dry-run", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1, stderr
    lines = stderr.strip().splitlines()
    assert lines[0].startswith("error: bad.toml:")
    return [lines[0].removeprefix("error: "), *lines[1:]]


def test_every_mistake_is_said_at_once_by_its_line_and_key(tmp_path, monkeypatch, capsys):
    said = mistakes(tmp_path, 'devise = "cpu"\n\n[axes]\nseed = [0, 1]\n\n[extract]\ndataset = "voc"\nresolution = -3'
                    '\n\n[linear]\nloss = "an"\nepochs = 0\nout = "x"\nbatchsize = 8\n', monkeypatch, capsys)
    assert said == [
        "bad.toml:1: devise: no stage of this file takes it; did you mean device?",
        "bad.toml:4: [axes] seed: no stage of this file takes it; did you mean seeds?",
        "bad.toml:8: [extract] resolution -3: use a side between 32 and 2048 pixels (the papers use 448)",
        "bad.toml:12: [linear] epochs 0: use at least 1",
        "bad.toml:13: [linear] out: not in an experiment file (the runs folder is [experiment] runs)",
        "bad.toml:14: [linear] batchsize: not an option of spml-cache linear; did you mean batch_size?"]


def test_a_misspelt_name_is_said_on_its_line_with_the_closest(tmp_path, monkeypatch, capsys):
    said = mistakes(tmp_path, '[axes]\ndataset = ["voc",\n  "vocc"]\n[extract]\n[linear]\nloss = ["an", "rolee"]\n',
                    monkeypatch, capsys)
    assert said[0].startswith("bad.toml:3: [axes] dataset: unknown dataset 'vocc' (did you mean voc?)")
    assert said[1].startswith("bad.toml:6: [linear] loss: unknown loss 'rolee' (did you mean role?)")


@pytest.mark.parametrize("text, line", [
    ("[linear]\nloss = 'an'\n[finetune]\nloss = 'em'\n", "bad.toml:4: [finetune] loss em: no linear step of this"
     " file trains it (add it to [linear] loss), or set init = \"imagenet\" or from = RUN"),
    ("[experiment]\nname = 'x'\nrun = 'r'\n[report]\n", "bad.toml:3: [experiment] run: not a key of [experiment];"
     " its keys: name (the experiment's name, which names its state file (default: the file's name)); runs (the"
     " runs folder of its linear and finetune runs (default: runs))"),
    ("seeds = 2\n[axes]\nseeds = [1, 2]\n[linear]\nloss = 'an'\n", "bad.toml:1: seeds: also an axis (line 3): set"
     " it in one place"),
    ("[extract]\nweights = 'none'\n", "bad.toml:1: [extract] no dataset: give dataset = NAME, here, at the top of"
     " the file or as an axis"),
    ("[linear\nloss = 'an'\n", "bad.toml: not valid TOML: Expected ']' at the end of a table declaration (at line 1,"
     " column 8)"),
])
def test_each_mistake_is_one_line_naming_the_key_and_the_fix(tmp_path, monkeypatch, capsys, text, line):
    assert mistakes(tmp_path, text, monkeypatch, capsys) == [line]


def test_a_mistake_leads_to_those_it_causes_each_on_its_line(tmp_path, monkeypatch, capsys):
    assert mistakes(tmp_path, "[axes]\nloss = 'an'\n[linear]\n", monkeypatch, capsys) == [
        "bad.toml:2: [axes] loss: give a list of the values to run, e.g. loss = [A, B]",
        "bad.toml:3: [linear] no loss: give loss = a name, a list or \"all\""]
    assert mistakes(tmp_path, "weights = 'none'\n", monkeypatch, capsys) == [
        "bad.toml: no stage to run: give at least one of [extract], [import-features], [linear], [finetune], [report]",
        "bad.toml:1: weights: no stage of this file takes it"]


def test_one_mistake_from_a_subprocess_is_one_error_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "one.toml").write_text("[linear]\nloss = 'an'\nlr = 'fast'\n")
    line = one_error_line(["run", "one.toml"], subprocess_too=True, cwd=tmp_path, monkeypatch=monkeypatch,
                          capsys=capsys)
    assert line.startswith("error: one.toml:3: [linear] lr 'fast': ")
    assert one_error_line(["run", "gone.toml"], subprocess_too=True, cwd=tmp_path, monkeypatch=monkeypatch,
                          capsys=capsys) == ("error: gone.toml does not exist: give an experiment file"
                                             " (docs/experiments.md)")


def test_the_state_of_another_file_is_refused(tmp_path, monkeypatch, capsys):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "same.toml").write_text("[experiment]\nruns = '../runs'\n[linear]\ncache = 'c.h5'\n"
                                                   "loss = 'an'\n")
    state = tmp_path / "runs" / "experiments" / "same.json"
    state.parent.mkdir(parents=True)
    state.write_text(f'{{"file": "{tmp_path / "a" / "same.toml"}", "made": {{}}}}')
    line = one_error_line(["run", "same.toml"], subprocess_too=False, cwd=tmp_path / "b", monkeypatch=monkeypatch,
                          capsys=capsys)
    assert line == (f"error: ../runs/experiments/same.json is the state of the experiment {tmp_path}/a/same.toml,"
                    f" not of {tmp_path}/b/same.toml: give this one another name ([experiment] name = ...) or another"
                    " runs folder ([experiment] runs)")


def test_the_axes_product_each_step_once_and_what_reads_what(tmp_path):
    (tmp_path / "plan.toml").write_text("""
weights = "none"
[axes]
dataset = ["voc", { dataset = "nus", skip_missing = true }]
resolution = [32, 64]
[extract]
[linear]
loss = "all"
[[finetune]]
loss = "role"
[[finetune]]
init = "imagenet"
loss = "em"
[report]
""")
    plan = make_plan(tmp_path / "plan.toml")
    assert plan.count() == "4 extract, 4 linear, 8 finetune, 1 report"
    commands = [step.command() for step in plan.steps]
    assert len(set(commands)) == len(commands)
    assert commands[:4] == [
        "spml-cache extract voc --weights none --resolution 32",
        "spml-cache linear --loss all --cache cache/voc-resnet50-32.h5",
        "spml-cache finetune --from '<run of step 2>' --loss role --weights none --resolution 32",
        "spml-cache finetune --init imagenet --cache cache/voc-resnet50-32.h5 --loss em --weights none --resolution"
        " 32"]
    assert "spml-cache extract nus --weights none --resolution 64 --skip-missing" in commands
    assert commands[-1] == "spml-cache report " + " ".join(
        f"'<run of step {step.number}>'" for step in plan.steps if step.stage.makes == "run")


def test_a_key_names_an_option_by_its_flag_or_its_keyword(tmp_path):
    (tmp_path / "keys.toml").write_text("[linear]\ncache = 'c.h5'\nloss = 'an'\nbatch-size = 8\nlr = [0.1]\n"
                                        "from = 'r'\nno_graphs = true\n")
    (step,) = make_plan(tmp_path / "keys.toml").steps
    assert step.command() == "spml-cache linear --loss an --cache c.h5 --lr 0.1 --batch-size 8 --from r --no-graphs"
    (tmp_path / "keys.toml").write_text("[linear]\ncache = 'c.h5'\nloss = 'an'\nresume = 'r'\n")
    with pytest.raises(SpmlError, match=r"keys.toml:4: \[linear\] resume: not in an experiment file \(an experiment"
                       r" goes on with its own runs \(run it again\)\)"):
        make_plan(tmp_path / "keys.toml")


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.toml")), ids=lambda path: path.name)
def test_each_recipe_under_examples_prints_its_commands(tmp_path, example):
    done = run_cli("run", str(example), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [line.split("  # ")[0] for line in done.stdout.splitlines() if not line.startswith("#")]
    assert lines and all(line.startswith("spml-cache ") for line in lines)
    assert_flags_exist(lines, tmp_path)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()  # a dry run writes nothing


def test_table1_is_the_papers_recipe(tmp_path):
    """Cole et al.'s "+LinearInit" rows from the best head of the same loss; Zhou's, Chen's and Li's from ImageNet;
    every loss's linear heads on each of the four datasets, NUS's missing images skipped (what
    scripts/reproduce_table1.sh ran)."""
    plan = make_plan(REPO / "examples" / "table1.toml")
    commands = [step.command() for step in plan.steps]
    assert commands[:9] == [
        "spml-cache extract voc", "spml-cache linear --loss all --cache cache/voc-resnet50-448.h5 --seeds 3",
        *(f"spml-cache finetune --init best --from '<run of step 2>' --loss {loss} --seeds 3"
          for loss in ("an_ls", "role")),
        *(f"spml-cache finetune --init imagenet --cache cache/voc-resnet50-448.h5 --loss {loss} --seeds 3"
          for loss in ("em", "em_apl", "gr", "opml", "opml_sp"))]
    assert [command for command in commands if command.startswith("spml-cache extract")] == [
        "spml-cache extract voc", "spml-cache extract coco", "spml-cache extract nus --skip-missing",
        "spml-cache extract cub"]
    assert commands[-2:] == [commands[-2].split(" --paper")[0] + " --paper",
                             commands[-2].split(" --paper")[0] + " --paper --format md --out table1.md --plots figures"]
