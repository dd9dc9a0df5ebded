"""scripts/bench_extract.py's pieces that run in seconds: the trunk variants and their deviation from fp32 (on a
small network), and the JSON it writes. The whole script on 8 images takes ~25 s on 2 CPU cores; it was run
by hand for docs/benchmarks/extract-cpu.json."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from extract_support import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_extract", REPO / "scripts" / "bench_extract.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deviation_is_relative_to_each_row_and_counts_rows_not_finite(bench):
    reference = np.array([[10.0, 0.0], [1.0, 1.0], [2.0, 2.0]])
    got = np.array([[10.0, 0.5], [1.0, 1.01], [np.inf, 2.0]])
    assert bench.deviation(got, reference) == (pytest.approx(0.05), 1)


def test_trunk_variants_report_speed_and_deviation_per_precision_and_layout(bench):
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten()).eval()  # fmt: skip
    batch = torch.randn(4, 3, 16, 16)
    rows = bench.trunk_variants(trunk, batch, ["fp32", "fp32-cl", "bf16-cl"], 1, torch.device("cpu"), None)
    assert [row["variant"] for row in rows] == ["fp32", "fp32-cl", "bf16-cl"]
    assert rows[0]["max_relative_deviation"] == 0.0 and rows[1]["max_relative_deviation"] < 1e-5
    assert 1e-5 < rows[2]["max_relative_deviation"] < 0.1  # bf16 keeps 8 bits of mantissa
    assert all(row["images_per_s"] > 0 and row["nonfinite_rows"] == 0 for row in rows)


def test_main_writes_its_figures_as_json(bench, tmp_path, monkeypatch):
    figures = {"device": {"type": "cpu", "name": "Some CPU"}, "end_to_end": {"warm": {"images_per_s": 3.0}}}
    monkeypatch.setattr(bench, "measure", lambda args: figures | {"settings": {"images": args.images}})
    bench.main(["--images", "8", "--json", str(tmp_path / "out" / "bench.json")])
    assert json.loads((tmp_path / "out" / "bench.json").read_text()) == figures | {"settings": {"images": 8}}
    assert bench.slug(torch.device("cuda"), "NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert bench.slug(torch.device("cpu"), "AMD EPYC") == "cpu"
    with pytest.raises(SystemExit):
        bench.parse(["--variants", "fp32,fp8"])
