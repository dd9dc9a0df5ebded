"""A broken install met as a command starts: torchvision built for another torch (`RuntimeError: operator
torchvision::nms does not exist`, what a half-done CPU-only install left) is one line naming the pair to install.
The failure is simulated in the subprocess by a sitecustomize that makes `import torchvision` raise what a
mismatched torchvision raises."""

from __future__ import annotations

import os
import re
import shlex
from importlib import metadata

import pytest
from cli_support import REPO, run_cli

from spml_cache.runtime.install import CPU_INDEX, matching_pair, mismatched_torchvision

SITECUSTOMIZE = '''
import sys

class BrokenTorchvision:
    """As torchvision imports beside a torch it was not built for."""
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return None

sys.meta_path.insert(0, BrokenTorchvision())
'''


def restated_pair(torch_version: str) -> tuple[str, str]:
    """torch 2.M.P goes with torchvision 0.(M+15): (torch pin, torchvision pin), from the torch version itself."""
    major, minor, patch = re.match(r"(\d+)\.(\d+)\.(\d+)", torch_version).groups()
    assert major == "2"
    return f"torch=={major}.{minor}.{patch}", f"torchvision==0.{int(minor) + 15}.*"


@pytest.mark.parametrize("args", [["demo", "--out", "demo"], ["extract", "voc", "--root", "."]],
                         ids=["demo", "extract"])
def test_a_torchvision_of_another_torch_is_one_line_with_the_pair_to_install(tmp_path, args):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    done = run_cli(*args, cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join([str(REPO), str(hook)])}, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: torchvision ") and "operator torchvision::nms does not exist" in line
    assert f"the installed torch {metadata.version('torch')}" in line
    command = shlex.split(line.split("install the matching pair: ")[1])
    assert command[:4] == ["python", "-m", "pip", "install"]
    assert set(restated_pair(metadata.version("torch"))) <= set(command)
    assert not (tmp_path / "demo").exists()  # caught as the command starts, before any work


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.4.1", "2.14.1+cu130"])
def test_the_pair_named_is_the_torchvision_of_that_torch_from_its_index(version):
    words = shlex.split(matching_pair(version))
    assert set(restated_pair(version)) <= set(words)
    assert ("--index-url" in words) == version.endswith("+cpu")
    if version.endswith("+cpu"):
        assert words[words.index("--index-url") + 1] == CPU_INDEX


def test_other_errors_are_left_alone():
    assert mismatched_torchvision(RuntimeError("CUDA out of memory")) is None
    assert mismatched_torchvision(ValueError("operator torchvision::nms does not exist")) is None
    assert "pytorch.org" in matching_pair("3.0.0")
