"""What every command shares: help that does not mislead, --debug anywhere, one line per error or warning."""

import pytest

from cli_support import run_cli, run_main

COMMANDS = ["datasets", "make-demo-data", "extract", "import-features", "export", "losses", "linear", "demo", "finetune", "report"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_flags_without_a_value_type(tmp_path, command):
    done = run_cli(command, "--help", cwd=tmp_path)
    assert done.returncode == 0 and "Example:" in done.stdout
    assert "<bool>" not in done.stdout  # a flag takes no value


def test_debug_works_after_the_command_too(tmp_path):
    before = run_cli("--debug", "linear", "--cache", "missing.h5", "--loss", "an", cwd=tmp_path)
    after = run_cli("linear", "--cache", "missing.h5", "--loss", "an", "--debug", cwd=tmp_path)
    for done in (before, after):
        assert done.returncode == 1 and "Traceback" in done.stderr and "SpmlError" in done.stderr
    plain = run_cli("linear", "--cache", "missing.h5", "--loss", "an", cwd=tmp_path)
    assert plain.returncode == 1 and plain.stderr.count("\n") == 1 and plain.stderr.startswith("error: no cache at")


def example_lines(help_text: str) -> list[str]:
    """The help's example lines as printed, and each line that continues one (a wrapped example)."""
    lines, inside = [], False
    for line in help_text.splitlines():
        text = line.strip()
        inside = text.startswith("Example:") or (inside and bool(text) and not text.startswith(("╭", "│")))
        if inside:
            lines.append(text)
    return lines


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_examples_survive_80_columns(tmp_path, command):
    args = ["--help"] if command is None else [command, "--help"]
    wide, narrow = (run_cli(*args, cwd=tmp_path, env={"COLUMNS": columns}).stdout for columns in ("400", "80"))
    examples = example_lines(wide)
    assert examples and all(example.startswith("Example: spml-cache") for example in examples)
    rendered = example_lines(narrow)
    for example in examples:  # each flag beside its value on one printed line (a wrap there breaks pasting)
        words = example.split()
        for flag, value in zip(words, words[1:]):
            if flag.startswith("--") and not value.startswith("-"):
                assert any(f"{flag} {value}" in line for line in rendered), (flag, value, rendered)
    assert rendered == examples  # and each example is whole on its own line, so pasting it runs all of it


@pytest.mark.parametrize("args, expected", [
    (["linear", "--loss", "rolee", "--cache", "missing.h5"], "unknown loss 'rolee' (did you mean role?); valid: bce,"),
    (["linear", "--loss", "an,an_lss", "--cache", "missing.h5"], "unknown loss 'an_lss' (did you mean an_ls?)"),
    (["finetune", "--loss", "rolee@entry:0.1", "--dataset", "voc", "--root", "."], "(did you mean role?)"),
    (["linear", "--loss", "an", "--observe", "singel", "--cache", "m.h5"], "rule 'singel' (did you mean single?)"),
    (["extract", "vocc", "--root", "."], "unknown dataset 'vocc' (did you mean voc?); choose one of voc, coco"),
    (["import-features", ".", "--dataset", "cocoo"], "unknown dataset 'cocoo' (did you mean coco?)"),
    (["report", "--format", "mdd"], "--format mdd: unknown format 'mdd' (did you mean md?); use one of csv, md"),
    (["linear", "--loss", "xyzzy", "--cache", "missing.h5"], "unknown loss 'xyzzy'; valid: bce,"),  # nothing close
])  # fmt: skip
def test_a_misspelt_name_gets_the_closest_one_beside_the_list(tmp_path, monkeypatch, capsys, args, expected):
    code, err = run_main(*args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and expected in err, err


def test_a_misspelt_loss_from_a_subprocess(tmp_path):
    done = run_cli("linear", "--loss", "rolee", "--cache", "missing.h5", cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.startswith("error: unknown loss 'rolee' (did you mean role?); valid:")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
