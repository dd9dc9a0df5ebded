"""Benchmark `spml-cache report --ci` (and `--metric cf1 --ci`, `--compare a,b`) on run directories shaped like the
papers' test sets.

Writes one linear run directory per shape through the stages' own writers (`runs.write_scores` with every seed's
test scores, `runs.write_labels`, a results.json per loss): `--losses` losses (28 by default, the registry's
first 28), each with `--seeds` seeds of synthetic sigmoid scores over a test split of VOC's shape (5,823 images x
20 classes, ~1.4 positives per image) or COCO's (40,137 x 80, ~2.9), then times `report_command` itself, as
`spml-cache report` runs it (reading the files, the table, the resamples, the intervals), each case `--repeat`
times (the median is reported; the machine may be shared).

Usage: python scripts/bench_report.py [--shape voc|coco] [--losses 28] [--seeds 1] [--resamples 1000]
       [--repeat 3] [--cases ci,cf1,compare] [--json docs/benchmarks/NAME.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spml_cache import losses, runs  # noqa: E402
from spml_cache.report import ReportOptions, report_command  # noqa: E402

SHAPES = {"voc": (5823, 20, 1.4), "coco": (40137, 80, 2.9)}  # test images, classes, positives per image
CASES = {  # what `spml-cache report` is asked
    "ci": {"ci": True},
    "cf1": {"ci": True, "metric": "cf1"},
    "compare": {"compare": "an,role"},
}


def write_runs(root: Path, shape: str, num_losses: int, seeds: int) -> list[str]:
    """One linear run of `num_losses` losses on a synthetic test split of `shape`, every file as a stage writes it."""
    rows, classes, per_image = SHAPES[shape]
    rng = np.random.default_rng(0)
    labels = (rng.random((rows, classes)) < per_image / classes).astype(np.uint8)
    names = losses.names()[:num_losses]
    run_dir = root / "voc" / "linear-all-20260101-000000"
    run_dir.mkdir(parents=True)
    runs.write_json(run_dir / "config.json", {"stage": "linear", "dataset": "voc", "cache_id": "bench",
                                               "losses": names, "seeds": list(range(seeds))})
    runs.write_labels(run_dir, train_labels=labels, train_observed=labels, val_labels=labels, test_labels=labels)
    entries = {}
    for index, name in enumerate(names):
        signal = 2.0 + 0.02 * index  # each loss a little better than the one before
        logits = signal * (2 * labels - 1) + rng.normal(scale=2.0, size=(seeds, rows, classes))
        scores = torch.sigmoid(torch.from_numpy(logits).float())
        runs.write_scores(run_dir, name, runs.SeedScores(list(range(seeds)), scores, labels), test=scores[0])
        per_seed = [50.0 + 0.1 * index] * seeds  # the table's mAP (results.json): not what is timed
        entries[name] = {"selected": {"lr": 1e-3, "batch_size": 8, "hparams": {}}, "test_map": float(np.mean(per_seed)),
                         "test_map_std": 0.0, "per_seed": [{"seed": s, "test_map": v} for s, v in enumerate(per_seed)]}
    runs.write_json(run_dir / runs.RESULTS, {"stage": "linear", "dataset": "voc", "cache_id": "bench",
                                             "complete": True, "losses": entries})
    return names


def time_case(root: Path, case: str, resamples: int, repeat: int) -> dict:
    seconds = []
    for _ in range(repeat):
        options = ReportOptions([root], resamples=resamples, **CASES[case])
        start = time.perf_counter()
        report_command(options, Console(file=io.StringIO(), width=200))
        seconds.append(round(time.perf_counter() - start, 2))
        print(f"  {case}: {seconds[-1]} s", flush=True)
    return {"seconds": seconds, "median": float(np.median(seconds))}


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="voc")
    parser.add_argument("--losses", type=int, default=28)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default="ci,cf1,compare")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "runs"
        start = time.perf_counter()
        names = write_runs(root, args.shape, args.losses, args.seeds)
        print(f"wrote {len(names)} losses x {args.seeds} seeds ({args.shape}) in {time.perf_counter() - start:.1f} s",
              flush=True)
        figures = {case: time_case(root, case, args.resamples, args.repeat) for case in args.cases.split(",")}
    rows, classes, _ = SHAPES[args.shape]
    result = {
        "script": "scripts/bench_report.py", "argv": sys.argv[1:], "shape": args.shape, "test_images": rows,
        "classes": classes, "losses": len(names), "seeds": args.seeds, "resamples": args.resamples,
        "cases": {case: {"flags": CASES[case], **found} for case, found in figures.items()},
        "device": "cpu", "device_name": cpu_name(), "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "load_average_after": list(os.getloadavg()),
        "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
