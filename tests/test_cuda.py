"""On a GPU the pipeline gives what it gives on the CPU, and nothing non-finite is written or reported.

Marked `cuda`: skipped where no CUDA GPU is visible; `python -m pytest -m cuda` runs just these. Demo-sized data
at 448 px, where fp16 extraction once wrote non-finite rows (at 128 px it never did).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_support import run_cli
from linear_support import quiet, write_synthetic_cache

from spml_cache import cache, losses, report, runs
from spml_cache.demo.data import make_demo_data
from spml_cache.extract import extract
from spml_cache.finetune import finetune
from spml_cache.linear import run_linear

pytestmark = pytest.mark.cuda
GRID = dict(losses=["an", "role", "em"], lrs=[1e-2, 1e-3, 1e-4, 1e-5], batch_sizes=[8, 16], epochs=5)



@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("cuda")
    root = make_demo_data(base / "data", num_train=400, num_test=200, size=448, seed=0)
    extracted = extract("voc", root, out=base / "voc-resnet50-448.h5", weights="none", resolution=448, device="cuda")
    return base, root, extracted


def test_extraction_on_the_gpu_writes_a_finite_cache(world):
    _, _, extracted = world
    features = cache.load(extracted.path)  # refuses non-finite features itself; checked again here
    assert features.attrs["precision"] == "fp16" and "cuda" in features.attrs["device"]
    for split in (features.train, features.val, features.test):
        assert np.isfinite(split.features).all()
    assert sum(extracted.counts.values()) == 600


def test_linear_on_cuda_selects_what_the_cpu_selects(tmp_path):
    """On features that carry their labels (tests/linear_support.py), where every selected curve still climbs by
    0.4 mAP or more an epoch and the best configs stand 2 mAP apart. Measured on the CPU: features perturbed by up
    to 1e-4 relative (100x fp32's rounding gap between the GPU and the CPU) changed no selection, epoch or test
    mAP; 1e-3 moved one test mAP by 0.03; the selection held up to 1e-2. (The demo's random-trunk features, with
    entries up to 90, train chaotically at lr 1e-3 and 1e-2: GPU and CPU curves part by several mAP there.)"""
    learnable = write_synthetic_cache(tmp_path / "learnable.h5")
    on_gpu = run_linear(cache=learnable, device="cuda", out=tmp_path / "gpu", console=quiet(), **GRID)
    on_cpu = run_linear(cache=learnable, device="cpu", out=tmp_path / "cpu", console=quiet(), **GRID)
    for name in GRID["losses"]:
        gpu, cpu = on_gpu.results["losses"][name], on_cpu.results["losses"][name]
        assert gpu["selected"] == cpu["selected"], name
        assert gpu["best_epoch"] == cpu["best_epoch"], name
        assert gpu["test_map"] == pytest.approx(cpu["test_map"], abs=0.1), name


def test_finetune_on_cuda_starts_from_the_linear_head(world, tmp_path):
    """Epoch 0, before any step, is the linear head on the trunk that made the cache, scored from the images:
    decoded as the cache was (nvjpeg here, the cache's recorded decoder) and with the trunk in the precision
    fine-tuning scores in (bf16, so this cache is extracted in bf16; the head in float32, as stage two applies it).
    What is left is the order of fp32 sums inside the convolutions, which cuDNN picks per batch shape (64 images
    extracting, 32 scoring): 2.7e-6 relative in fp32 on the H200, enough to round a bf16 activation the other way
    now and then. 0.1 mAP stands below what a real mismatch costs: the head of an fp16 cache scored with the trunk
    and the head in bf16 moved val mAP by 0.30 on the H200 (2026-11-26); bf16 against fp32 features moved it by
    0.43 on this demo on the CPU (64 px); nvjpeg against libjpeg-turbo moves these features by 1.1e-2, as much as
    bf16's own error."""
    _, root, _ = world
    bf16 = extract("voc", root, out=tmp_path / "voc-bf16.h5", weights="none", resolution=448, device="cuda",
                   precision="bf16")
    assert cache.load(bf16.path).attrs["decoder"] == "nvjpeg"
    linear = run_linear(cache=bf16.path, losses=["an_ls"], lrs=[1e-3], batch_sizes=[8], epochs=3, device="cuda",
                        out=tmp_path, console=quiet())
    results = finetune(init="best", from_run=linear.run_dir, loss="an_ls", root=root, weights="none", epochs=1,
                       lrs=[1e-4], batch_sizes=[8], device="cuda", out=tmp_path)
    entry = results["losses"]["an_ls"]
    assert entry["selected"] is not None and math.isfinite(entry["test_map"]) and math.isfinite(entry["val_map"])
    assert runs.read_json(Path(results["run_dir"]) / "config.json")["decode"] == "gpu"  # the cache's
    for key in ("val_map", "test_map"):
        assert entry["start"][key] == pytest.approx(linear.results["losses"]["an_ls"][key], abs=0.1), key
    table = report.build_table(report.collect_runs([tmp_path]))
    cells = [cell for _, row in table.rows for cell in row.values()]
    assert len(cells) == 2 and all(math.isfinite(cell.mean) for cell in cells)


def test_the_demo_on_a_gpu_reports_every_loss(tmp_path):
    sizes = ["--size", "448", "--resolution", "448", "--epochs", "3"]
    done = run_cli("demo", "--out", "out", "--device", "cuda", *sizes, cwd=tmp_path, env={"TORCH_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "out" / "runs" / "voc").glob("linear-*")
    results = json.loads((run_dir / "results.json").read_text())["losses"]
    assert list(results) == losses.names(similarity=False)
    assert all(entry.get("test_map") is not None for entry in results.values()), "a loss without a result"
    assert any((tmp_path / "out" / "plots").glob("*val_curves.png"))
