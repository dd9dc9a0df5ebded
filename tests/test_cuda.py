"""On a GPU the pipeline gives what it gives on the CPU, and nothing non-finite is written or reported.

Marked `cuda`: skipped where no CUDA GPU is visible; `python -m pytest -m cuda` runs just these. Demo-sized data
at 448 px, where fp16 extraction once wrote non-finite rows (at 128 px it never did).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from cli_support import run_cli
from linear_support import quiet

from spml_cache import cache, losses, report
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


def test_linear_on_cuda_selects_what_the_cpu_selects(world, tmp_path):
    _, _, extracted = world
    on_gpu = run_linear(cache=extracted.path, device="cuda", out=tmp_path / "gpu", console=quiet(), **GRID)
    on_cpu = run_linear(cache=extracted.path, device="cpu", out=tmp_path / "cpu", console=quiet(), **GRID)
    for name in GRID["losses"]:
        gpu, cpu = on_gpu.results["losses"][name], on_cpu.results["losses"][name]
        assert gpu["selected"] == cpu["selected"], name
        assert gpu["best_epoch"] == cpu["best_epoch"], name
        assert gpu["test_map"] == pytest.approx(cpu["test_map"], abs=0.1), name


def test_finetune_on_cuda_gives_finite_results(world, tmp_path):
    base, root, extracted = world
    linear = run_linear(cache=extracted.path, losses=["an_ls"], lrs=[1e-3], batch_sizes=[8], epochs=3, device="cuda",
                        out=tmp_path, console=quiet())
    results = finetune(init="best", from_run=linear.run_dir, loss="an_ls", root=root, weights="none", epochs=1,
                       lrs=[1e-4], batch_sizes=[8], device="cuda", out=tmp_path)
    entry = results["losses"]["an_ls"]
    assert entry["selected"] is not None and math.isfinite(entry["test_map"]) and math.isfinite(entry["val_map"])
    # epoch 0, before any step: the linear head on the (seeded random) trunk that made the cache, on the same GPU
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
