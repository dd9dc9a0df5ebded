"""A broken install met as a command starts: torchvision built for another torch (`RuntimeError: operator
torchvision::nms does not exist`, what a half-done CPU-only install left) is one line naming the pair to install.
The failure is simulated in the subprocess by a sitecustomize that makes `import torchvision` raise what a
mismatched torchvision raises. The line itself is run by pip against a package index written here (two builds of
one torch and torchvision release, as PyPI and PyTorch's CPU index serve them), in a new virtual environment."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from cli_support import REPO, run_cli

from spml_cache.runtime import install
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
    uninstall, command = (shlex.split(part) for part in line.split("install the matching pair: ")[1].split(" && "))
    assert uninstall == ["python", "-m", "pip", "uninstall", "-y", "torchvision"]
    assert command[:4] == ["python", "-m", "pip", "install"]
    assert set(restated_pair(metadata.version("torch"))) <= set(command)
    assert not (tmp_path / "demo").exists()  # caught as the command starts, before any work


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.4.1", "2.14.1+cu130", "2.9.1+rocm6.4"])
def test_the_pair_named_is_the_torchvision_of_that_torch_from_its_index(version):
    words = shlex.split(matching_pair(version).split(" && ")[1])
    assert set(restated_pair(version)) <= set(words)
    build = version.partition("+")[2]  # PyPI serves no local label: a build named is PyTorch's index of it
    assert ("--index-url" in words) == bool(build)
    if build:
        assert words[words.index("--index-url") + 1] == f"https://download.pytorch.org/whl/{build}"
    assert CPU_INDEX == "https://download.pytorch.org/whl/cpu"


def write_wheel(folder, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A wheel of distribution `name` that holds nothing but its metadata, the RECORD with its hashes included."""
    info = f"{name}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test_install\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()] + [f"{info}/RECORD,,"]
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in [*files.items(), (f"{info}/RECORD", "\n".join(record) + "\n")]:
            wheel.writestr(path, text)


def write_index(root, builds: dict[str, str]) -> str:
    """A PEP 503 package index at `root` of torch (version `builds["torch"]`) and its torchvision, as a file URL."""
    for name, version in builds.items():
        requires = (f"torch=={builds['torch'].partition('+')[0]}",) if name == "torchvision" else ()
        write_wheel(root / name, name, version, requires)
        wheel = f"{name}-{version}-py3-none-any.whl"
        (root / name / "index.html").write_text(f'<html><body><a href="{wheel.replace("+", "%2B")}">{wheel}</a></body></html>')
    return root.as_uri()


def new_venv(tmp_path, pypi: str):
    """A new virtual environment with pip, and an environment in which `python -m pip` is its pip with `pypi` as
    the default index and no configuration of this machine's (its own index, find-links, constraints)."""
    import pip

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    # this interpreter's pip, copied in: what ensurepip would install, in a second rather than twenty
    (site,) = venv.glob("lib/python*/site-packages")
    shutil.copytree(Path(pip.__file__).parent, site / "pip")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PIP_", "PYTHON")) and key != "VIRTUAL_ENV"}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=pypi,
               PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def sh(line: str, env) -> str:
    done = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def installed(env) -> tuple[str, str]:
    return tuple(sh("python -c 'from importlib.metadata import version as v; print(v(\"torch\"), v(\"torchvision\"))'",
                    env).split())


@pytest.mark.parametrize("torch_build", ["cpu", "pypi"])
def test_the_line_given_installs_the_torchvision_of_that_torch_where_only_the_builds_differ(tmp_path, torch_build):
    """A `+cpu` torch beside PyPI's torchvision of the same release (or PyPI's torch beside a `+cpu` torchvision):
    pip takes the line without --force or an uninstall as already satisfied, and the line given mends it."""
    pypi = write_index(tmp_path / "pypi", {"torch": "2.13.0", "torchvision": "0.28.0"})
    write_index(tmp_path / "whl" / "cpu", {"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"})
    env = new_venv(tmp_path, pypi)
    cpu = f"--index-url {(tmp_path / 'whl' / 'cpu').as_uri()}"
    torch_from, torchvision_from = (cpu, "") if torch_build == "cpu" else ("", cpu)
    sh(f"python -m pip install torch==2.13.0 {torch_from} && python -m pip install torchvision==0.28.0 {torchvision_from}"
       " --no-deps", env)
    torch_version = "2.13.0+cpu" if torch_build == "cpu" else "2.13.0"
    mismatched = installed(env)
    assert mismatched == (torch_version, "0.28.0" if torch_build == "cpu" else "0.28.0+cpu")
    line = matching_pair(torch_version).replace(install.PYTORCH_INDEX, (tmp_path / "whl").as_uri())
    # the line as it was: the same pins, no uninstall: pip finds them satisfied, nothing changes
    said = sh(line.split(" && ")[1], env)
    assert "Requirement already satisfied: torchvision==0.28.*" in said and installed(env) == mismatched
    sh(line, env)
    assert installed(env) == (torch_version, "0.28.0+cpu" if torch_build == "cpu" else "0.28.0")


def test_other_errors_are_left_alone():
    assert mismatched_torchvision(RuntimeError("CUDA out of memory")) is None
    assert mismatched_torchvision(ValueError("operator torchvision::nms does not exist")) is None
    assert "pytorch.org" in matching_pair("3.0.0")
