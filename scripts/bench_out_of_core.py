"""Benchmark stage two out of core (`spml-cache linear --memory-budget`).

Two parts:

- `--part voc`: the effect of the chunk order on mAP. A VOC-shaped synthetic cache (bench_linear.py's: 4,574 /
  1,143 / 5,823 rows, 2,048-d, 20 classes) trains one loss's grid in memory (a full shuffle per epoch) and out
  of core (the train features streamed in chunks of `--chunk-rows` rows: a seeded chunk permutation per epoch,
  rows shuffled within a chunk), over `--seeds` seeds; the JSON holds both runs' val/test mAP and the
  differences. The chunk size is forced (what a budget would give depends on the process's memory), so that
  the figure names the chunk size it holds for.
- `--part big`: a synthetic OpenImages-scale cache, `--rows` x 2,048 float16 features (default 500,000, ~2 GB)
  with `--classes` classes (default 5,000) stored sparse (1-3 positives per row), built once at `--cache-path`
  (not in the tests), then `spml-cache linear` in a child process with `--memory-budget` (default 1GB): the
  child's peak resident memory (`ru_maxrss` of the waited-for child), its wall time and the run's figures.

Usage: python scripts/bench_out_of_core.py --part voc [--loss an] [--seeds 3] [--epochs 25] [--chunk-rows 512]
       python scripts/bench_out_of_core.py --part big [--rows 500000] [--classes 5000] [--memory-budget 1GB]
           [--lr 1e-3] [--batch-size 256] [--epochs 1] [--cache-path /tmp/big.h5]
       ... [--json docs/benchmarks/NAME.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_linear import FEATURE_DIM, cpu_name, synthetic_cache  # noqa: E402

from spml_cache import cache
from spml_cache.labels import SparseLabels
from spml_cache.linear import out_of_core, run_linear  # noqa: E402
from spml_cache.linear.out_of_core import MemoryPlan  # noqa: E402
from spml_cache.runtime import memory  # noqa: E402


def voc_part(args) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="bench-ooc-"))
    path = synthetic_cache(folder, "voc")
    runs = {}
    original = out_of_core.plan
    for mode in ("in_memory", "out_of_core"):
        if mode == "out_of_core":
            out_of_core.plan = lambda budget, *rest: MemoryPlan(
                budget=budget, train_in_memory=False, eval_in_memory=True, chunk_rows=args.chunk_rows, class_block=0)
        start = time.perf_counter()
        run = run_linear(cache=path, losses=[args.loss], epochs=args.epochs, seeds=args.seeds, device="cpu",
                         out=folder / mode, workers=1, console=Console(file=io.StringIO()))
        result = run.results["losses"][args.loss]
        runs[mode] = {"seconds": round(time.perf_counter() - start, 1), "val_map": result["val_map"],
                      "test_map": result["test_map"], "test_map_std": result["test_map_std"],
                      "per_seed_test_map": [seed["test_map"] for seed in result["per_seed"]],
                      "selected": result["selected"]}
        print(f"{mode}: test mAP {result['test_map']:.2f} +- {result['test_map_std']:.2f}, "
              f"val mAP {result['val_map']:.2f} ({runs[mode]['seconds']} s)", flush=True)
    out_of_core.plan = original
    per_seed = [b - a for a, b in zip(runs["in_memory"]["per_seed_test_map"], runs["out_of_core"]["per_seed_test_map"])]
    return {"shape": "voc", "loss": args.loss, "seeds": args.seeds, "epochs": args.epochs,
            "chunk_rows": args.chunk_rows, "runs": runs,
            "test_map_difference": runs["out_of_core"]["test_map"] - runs["in_memory"]["test_map"],
            "val_map_difference": runs["out_of_core"]["val_map"] - runs["in_memory"]["val_map"],
            "per_seed_test_map_difference": per_seed}


def sparse_split(rng, rows: int, classes: int) -> SparseLabels:
    """1-3 distinct positive classes per row, as CSR."""
    counts = rng.integers(1, 4, size=rows)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    indices = np.empty(int(indptr[-1]), dtype=np.int32)
    for count in (1, 2, 3):
        where = np.flatnonzero(counts == count)
        picks = _distinct(rng, len(where), count, classes)
        for k in range(count):
            indices[indptr[where] + k] = picks[:, k]
    return SparseLabels(indptr, indices, np.ones(len(indices), dtype=np.int8), classes)


def _distinct(rng, rows: int, count: int, classes: int) -> np.ndarray:
    """[rows, count] sorted distinct classes per row (redrawn where two collide)."""
    picks = rng.integers(0, classes, size=(rows, count))
    while count > 1:
        picks.sort(axis=1)
        clash = (np.diff(picks, axis=1) == 0).any(axis=1)
        if not clash.any():
            break
        picks[clash] = rng.integers(0, classes, size=(int(clash.sum()), count))
    return np.sort(picks, axis=1)


def single_positive(rng, labels: SparseLabels) -> SparseLabels:
    """One observed positive per row, drawn among its positives."""
    lengths = np.diff(labels.indptr)
    chosen = labels.indptr[:-1] + (rng.random(len(labels)) * lengths).astype(np.int64)
    indptr = np.arange(len(labels) + 1, dtype=np.int64)
    return SparseLabels(indptr, labels.indices[chosen], np.ones(len(labels), dtype=np.int8), labels.num_classes)


def build_big(path: Path, rows: int, classes: int, seed: int = 0) -> Path:
    """The synthetic sparse float16 cache: features = the sum of the positive classes' directions + noise."""
    rng = np.random.default_rng(seed)
    directions = (rng.standard_normal((classes, FEATURE_DIM), dtype=np.float32) * 0.5).astype(np.float32)
    splits = {}
    sizes = {"train": rows, "val": max(rows // 100, 1000), "test": max(rows // 50, 2000)}
    for name, count in sizes.items():
        labels = sparse_split(rng, count, classes)

        def features(start, stop, labels=labels, name=name):
            block_rng = np.random.default_rng([seed, start, len(name)])
            block = block_rng.standard_normal((stop - start, FEATURE_DIM), dtype=np.float32)
            for row in range(start, stop):
                block[row - start] += directions[labels.indices[labels.indptr[row] : labels.indptr[row + 1]]].sum(0)
            return block

        splits[name] = {"features": features, "labels": labels, "ids": [f"{name}/{i}" for i in range(count)]}
        if name != "test":
            splits[name]["observed"] = single_positive(rng, labels)
    attrs = {"dataset": "synthetic", "classes": json.dumps([f"c{c}" for c in range(classes)]),
             "num_classes": classes, "backbone": "resnet50", "weights": "synthetic", "resolution": 448,
             "feature_dim": FEATURE_DIM, "expected_positives": 2.0}
    return cache.write(path, attrs=attrs, **splits, labels="sparse", features="float16")


def big_part(args) -> dict:
    path = Path(args.cache_path)
    if not path.exists():
        start = time.perf_counter()
        build_big(path, args.rows, args.classes)
        seconds = time.perf_counter() - start
        print(f"built {path} ({path.stat().st_size / 2**30:.2f} GiB) in {seconds:.0f} s", flush=True)
    out = Path(tempfile.mkdtemp(prefix="bench-ooc-runs-"))
    command = [sys.executable, "-m", "spml_cache", "linear", "--cache", str(path), "--loss", args.loss, "--lr",
               args.lr, "--batch-size", args.batch_size, "--epochs", str(args.epochs), "--device", "cpu",
               "--memory-budget", args.memory_budget, "--out", str(out)]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter() - start, line.rstrip())
                                                          for line in child.stdout), daemon=True)
    reader.start()
    samples = []  # (seconds, anonymous, file-backed resident bytes) of the child, 4 times a second
    while child.poll() is None:
        samples.append((time.perf_counter() - start, *_resident(child.pid)))
        time.sleep(0.25)
    reader.join()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    output = "\n".join(line for _, line in lines)
    print(output[-3000:])
    done = subprocess.CompletedProcess(command, child.returncode, output, "")
    results = None
    found = sorted(out.glob("*/*/results.json"))
    if found:
        results = json.loads(found[-1].read_text())["losses"][args.loss]
    budget = memory.parse_size(args.memory_budget)
    return {"cache": {"rows": args.rows, "classes": args.classes, "feature_dim": FEATURE_DIM, "features": "float16",
                      "labels": "sparse (CSR)", "bytes": path.stat().st_size},
            "command": command[1:], "returncode": done.returncode, "seconds": round(seconds, 1),
            "memory_budget_bytes": budget, "peak_rss_bytes": peak, "peak_rss_under_budget": peak <= budget,
            "notes": [line for line in (done.stdout + done.stderr).splitlines() if "memory budget" in line],
            "test_map": results and results["test_map"], "val_map": results and results["val_map"],
            "resident_timeline": _timeline(samples, lines)}


def _resident(pid: int) -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of process `pid` now (0, 0 once it is gone)."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(("RssAnon:", "RssFile:")):
                    found[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found.get("RssAnon", 0), found.get("RssFile", 0)


def _timeline(samples: list, lines: list) -> list[dict]:
    """The sampled resident memory at most every 10 s, and its highest sample, each with the run's last line
    printed before it (which phase it was in)."""
    if not samples:
        return []
    highest = max(range(len(samples)), key=lambda i: samples[i][1] + samples[i][2])
    kept = [i for i in range(len(samples)) if i == highest or int(samples[i][0] // 10) != int(samples[i - 1][0] // 10)]
    return [{"seconds": round(samples[i][0], 1), "anonymous_bytes": samples[i][1], "file_bytes": samples[i][2],
             "highest": i == highest, "after": next((line for at, line in reversed(lines) if at <= samples[i][0]
                                                    and line.strip()), "")} for i in kept]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("voc", "big"), default="voc")
    parser.add_argument("--loss", default="an")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=None, help="default 25 (voc), 1 (big)")
    parser.add_argument("--chunk-rows", type=int, default=512)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--classes", type=int, default=5000)
    parser.add_argument("--memory-budget", default="1GB")
    parser.add_argument("--lr", default="1e-3")
    parser.add_argument("--batch-size", default="256")
    parser.add_argument("--cache-path", default=str(Path(tempfile.gettempdir()) / "bench-ooc-big.h5"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.epochs = args.epochs or (25 if args.part == "voc" else 1)
    torch.set_num_threads(os.cpu_count() or 1)
    load_before = os.getloadavg()
    figures = voc_part(args) if args.part == "voc" else big_part(args)
    report = {"script": "scripts/bench_out_of_core.py", "argv": sys.argv[1:], "device": "cpu",
              "device_name": cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "load_average": [load_before[0], os.getloadavg()[0]], **figures}
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
