"""What every command shares: help that does not mislead, --debug anywhere, one line per error or warning."""

import pytest

from cli_support import run_cli

COMMANDS = ["datasets", "make-demo-data", "extract", "import-features", "losses", "linear", "demo", "finetune", "report"]


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
