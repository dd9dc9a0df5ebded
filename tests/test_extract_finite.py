"""Stage one never writes a non-finite feature: rows non-finite in fp16/bf16 are recomputed in fp32; rows
non-finite even in fp32 are the backbone's fault, one line naming it whatever --on-bad-image says (they were once
left out as bad images, and a backbone giving NaN for every image sealed a cache of no rows, rc 0)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from extract_support import RESOLUTION, random_weights, write_numbered_csv_dataset
from PIL import Image
from rich.console import Console

from spml_cache import cache
from spml_cache.backbones import resnet50
from spml_cache.cli import text
from spml_cache.extract import extract
from spml_cache.runtime.errors import SpmlError

# Batches of 4 are train [0, 1, 2, 4] [5], val [3], test [6, 7, 8]: a black image alone in its batch, and one
# behind an undecodable image, so its place among the batch's decoded images is not its place in the batch.
BLACK = ["images/5.jpg", "images/7.jpg"]
UNDECODABLE = "images/6.jpg"
# On the CPU also with a GPU's padding and feed thread forced: padding rows (copies of a black image here) must
# never reach the finite check, the fp32 recompute or the bad-image handling.
FORCED = {"pad_batches": True, "feed_thread": True}
DEVICES = [
    pytest.param("cpu", {}, id="cpu"),
    pytest.param("cpu", FORCED, id="cpu-padded-fed"),
    pytest.param("cuda", {}, marks=pytest.mark.cuda, id="cuda"),
]
REDUCED = {"cpu": "bf16", "cuda": "fp16"}  # what each device's autocast runs fastest


class Overflowing(torch.nn.Module):
    """The real trunk, except that black images give inf features under reduced precision (as a trunk that
    overflows in fp16 does), or NaN features whatever the precision with `always`.

    A black image is told by its input alone (every normalised value negative), so which rows overflow does
    not depend on how the images are batched.
    """

    def __init__(self, trunk: torch.nn.Module, always: bool = False) -> None:
        super().__init__()
        self.trunk, self.always = trunk, always

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.trunk(x)
        reduced = x.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(x.device.type)
        if not (reduced or self.always):
            return out
        black = x.float().amax(dim=(1, 2, 3)) < 0
        return torch.where(black[:, None], float("nan") if self.always else float("inf"), out)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return random_weights(tmp_path_factory)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("finite")
    write_numbered_csv_dataset(root, 9, first_test=6, classes=("a", "b"), bad=(UNDECODABLE,))
    for image_id in BLACK:
        Image.new("RGB", (24, 20)).save(root / image_id, quality=90)
    return root


def options(weights, device="cpu", **overrides):
    return {"weights": str(weights), "resolution": RESOLUTION, "batch_size": 4, "workers": 0, "device": device,
            "on_bad_image": "skip", **overrides}  # fmt: skip


def patch_trunk(monkeypatch, always=False):
    build = resnet50.build_trunk
    monkeypatch.setattr(resnet50, "build_trunk", lambda weights: (Overflowing(build(weights)[0], always), "patched"))


def rows_of(loaded, image_ids):
    """{image id: its feature row} for the ids found in any split."""
    found = {}
    for name in cache.SPLITS:
        split = getattr(loaded, name)
        found |= {image_id: split.features[i] for i, image_id in enumerate(split.ids) if image_id in image_ids}
    return found


@pytest.mark.parametrize("device, forced", DEVICES)
def test_rows_that_overflow_in_reduced_precision_are_recomputed_in_fp32(
    tmp_path, monkeypatch, weights, data, device, forced
):
    if device == "cuda":  # TF32 convolutions would make fp32 rows of different batch sizes differ by ~1e-3
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    plain_run = extract("csv", data, out=tmp_path / "fp32.h5", **options(weights, device, precision="fp32"))
    plain = cache.load(plain_run.path)
    patch_trunk(monkeypatch)
    precision = REDUCED[device]
    reduced = options(weights, device, precision=precision, **forced)
    report = extract("csv", data, out=tmp_path / "reduced.h5", **reduced)
    loaded = cache.load(report.path)  # refuses a non-finite row: every row is finite
    expected = {"train": 1, "test": 1}  # images/5.jpg, images/7.jpg
    assert {name: count for name, count in report.recomputed.items() if count} == expected
    assert json.loads(loaded.attrs["recomputed_fp32"]) == expected
    note = f"2 images gave non-finite features in {precision} and were recomputed in fp32"
    assert any(note in line for line in report.notes)
    printed = Console(record=True, width=300)
    text.extract_report(report, printed)  # what `spml-cache extract` prints: the count is on the summary line
    summary = next(line for line in printed.export_text().splitlines() if line.startswith("extracted "))
    assert f", 2 recomputed in fp32 (non-finite in {precision})" in summary
    tolerance = 1e-4 if device == "cpu" else 1e-3  # cuDNN may pick another fp32 algorithm per batch size
    fresh, reference = rows_of(loaded, BLACK), rows_of(plain, BLACK)
    for image_id in BLACK:
        np.testing.assert_allclose(fresh[image_id], reference[image_id], rtol=tolerance, atol=tolerance)
    # The other rows really were computed in reduced precision, so the comparison above means something.
    others = [image_id for image_id in plain.train.ids if image_id not in BLACK]
    assert not np.allclose(rows_of(loaded, others)[others[0]], rows_of(plain, others)[others[0]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "precision, forced",
    [
        pytest.param("fp32", {}, id="fp32"),
        pytest.param("bf16", {}, id="bf16"),
        pytest.param("bf16", FORCED, id="bf16-padded-fed"),
    ],
)
def test_rows_not_finite_even_in_fp32_are_the_backbones_fault_skip_or_not(
    tmp_path, monkeypatch, weights, data, precision, forced
):
    patch_trunk(monkeypatch, always=True)
    out = tmp_path / "out.h5"
    partial = cache.partial_path(out)
    for on_bad_image in ("fail", "skip"):  # skip leaves out undecodable images, never a backbone's NaN rows
        with pytest.raises(SpmlError) as error:
            extract("csv", data, out=out, **options(weights, precision=precision, on_bad_image=on_bad_image, **forced))
        said = str(error.value)
        assert said.startswith("backbone resnet50 gave features that are not finite (NaN or inf) for image"
                               f" {data / 'images/5.jpg'}" + (", in fp32 too" if precision != "fp32" else "") +
                               ": the backbone is at fault, not the images: check its --weights or its code"), said
        assert "\n" not in said and said.endswith(f"(the rows done are kept in {partial})")
        assert not out.exists() and partial.exists()  # progress kept, nothing half-final
    with h5py.File(partial, "r") as file:  # the batch before the failing one was kept, no row flagged bad
        assert int(file["train"]["done"][...].sum()) == 4 and not file["train"]["bad"][...].any()
