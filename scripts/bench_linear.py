"""Benchmark stage two (`spml-cache linear`) against a straightforward reference loop.

Synthetic features shaped like the papers' datasets (VOC: 4,574 / 1,143 / 5,823 rows, COCO: 65,665 / 16,416 /
40,137 rows; 2,048-d, 20 or 80 classes; labels learnable from the features) are written to a temporary cache
through `spml_cache.cache.write`, then timed:

- `linear` for one loss's full grid (4 lrs x 2 batch sizes, 25 epochs, 1 seed), e.g. `an` and `role`;
- `linear --loss all`;
- a reference loop in the style of the authors' code: one head at a time, a per-sample Dataset and a
  DataLoader, torch.optim.Adam, sklearn AP on val and test after every epoch; timed for 2 epochs per config
  and extrapolated to 25.

- sweeps: `linear --loss L --hp L.key=v1,v2,...` beside the same loss with its defaults, in the same run
  (`--sweep L.key=v1,v2,...`), and every timed run with `--hp-grid paper`.
- observation rules: with `--observe R1,R2,...`, each timed run again under those rules (`linear --observe`,
  the rules drawn from the cache's labels), beside its time under `single` alone, and the ratio.
- `--compile N`: each timed run N times without and N times with `linear --compile`, interleaved, every stack
  compiled whatever its step count (`compiled.MIN_STEPS` 0: what compiling the default grid costs and gains),
  the first compiled run cold (an empty inductor cache), the others warm; the compile time each printed.
- fidelity: `--fidelity authors` times every run under the authors' rules (`linear --fidelity authors`: their
  logs' eps, dropped last batches, early stopping, so heads stop and their stacks capture graphs anew).

On a GPU every run is timed on the captured-graph path (the default) and, with `--eager`, again with
`--no-graphs`, so that one run measures both paths and the reference loop; the JSON holds the issue's targets
beside the figures (`TARGETS`, one seed, the papers' 8-config grid, 25 epochs).

`--losses` names the runs: a loss, `all`, or losses joined by `+` for one run of those losses together (what
scripts/gpu_checks.sh does to split COCO's `--loss all` into parts that each fit one 10-minute device call).
With `--json` the file is rewritten after every run, so a run cut short still leaves the figures taken so far.

Usage: python scripts/bench_linear.py [--shape voc|coco] [--losses an,role,all] [--device cpu|cuda] [--eager]
       [--seeds 1] [--epochs 25] [--reference-epochs 2] [--no-reference] [--sweep ll_r.delta=0.001,0.002]
       [--hp-grid paper] [--observe single,entry:0.1,entry:0.5] [--fidelity exact|authors] [--compile 3]
       [--json docs/benchmarks/NAME.json]
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
from sklearn.metrics import average_precision_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spml_cache import cache, losses  # noqa: E402
from spml_cache.linear import run_linear  # noqa: E402
from spml_cache.observation import parse_rules  # noqa: E402
from spml_cache.protocol import GRID_BATCH_SIZES, GRID_LRS  # noqa: E402
from spml_cache.protocol import observe_labels  # noqa: E402
from spml_cache.runtime.devices import resolve_device  # noqa: E402

SHAPES = {  # train, val, test, classes
    "voc": (4574, 1143, 5823, 20),
    "coco": (65665, 16416, 40137, 80),
}
FEATURE_DIM = 2048
# What stage two should take on one H100/H200 (seconds; 1 seed, 8 configs, 25 epochs): issue "Stage two on a GPU".
TARGETS = {("voc", "an"): 2.0, ("voc", "role"): 5.0, ("voc", "all"): 20.0, ("coco", "all"): 300.0}


def synthetic_cache(folder: Path, shape: str, seed: int = 0) -> Path:
    """A cache of post-ReLU-like features in which each class adds its own direction (learnable labels)."""
    num_train, num_val, num_test, num_classes = SHAPES[shape]
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((num_classes, FEATURE_DIM)).astype(np.float32) * 0.08
    splits = {}
    for name, rows in (("train", num_train), ("val", num_val), ("test", num_test)):
        labels = np.zeros((rows, num_classes), dtype=np.uint8)
        positives = rng.integers(1, 4, size=rows)
        for row, count in enumerate(positives):
            labels[row, rng.choice(num_classes, size=count, replace=False)] = 1
        features = np.empty((rows, FEATURE_DIM), dtype=np.float32)
        for start in range(0, rows, 8192):  # in blocks: COCO's matrix is 0.5 GB
            block = labels[start : start + 8192].astype(np.float32) @ directions
            block += rng.standard_normal(block.shape, dtype=np.float32)
            features[start : start + 8192] = np.maximum(block, 0)
        splits[name] = {"features": features, "labels": labels, "ids": [f"{name}/{i}" for i in range(rows)]}
        if name != "test":
            splits[name]["observed"] = observe_labels(labels)
    attrs = {
        "dataset": shape, "classes": json.dumps([f"class{c}" for c in range(num_classes)]),
        "num_classes": num_classes, "backbone": "resnet50", "weights": "synthetic", "resolution": 448,
        "feature_dim": FEATURE_DIM, "expected_positives": 2.0,
    }
    return cache.write(folder / f"{shape}-resnet50-448.h5", attrs=attrs, **splits)


def time_linear(path: Path, loss: str, epochs: int, device: str, out: Path, hparams: dict | None = None,
                hp_grid: str | None = None, graphs: bool = True, seeds: int = 1, observe: str | None = None,
                fidelity: str | None = None, **placement) -> tuple[float, dict, str]:
    """`loss`: one name, `all`, or names joined by `+` (one run of them together); `placement`: more of
    `run_linear`'s placement keywords (`compile_steps`). Returns the seconds, the results and what it printed."""
    start = time.perf_counter()
    printed = io.StringIO()
    run = run_linear(cache=path, losses=loss if loss == "all" else loss.split("+"), epochs=epochs, device=device,
                     out=out, hparams=hparams, hp_grid=hp_grid, graphs=graphs, seeds=seeds,
                     observe=observe and parse_rules(observe), fidelity=fidelity, console=Console(file=printed),
                     **placement)
    return time.perf_counter() - start, run.results, printed.getvalue()


class PerSampleFeatures(torch.utils.data.Dataset):
    """What the reference code feeds its DataLoader: one (features, observed labels, index) item at a time."""

    def __init__(self, features: np.ndarray, observed: np.ndarray) -> None:
        self.features, self.observed = torch.from_numpy(features), torch.from_numpy(observed)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int):
        return self.features[index], self.observed[index], index


def reference_map(model, split, batch_size: int, device) -> float:
    loader = torch.utils.data.DataLoader(PerSampleFeatures(split.features, split.labels), batch_size=batch_size)
    with torch.no_grad():
        scores = torch.cat([torch.sigmoid(model(x.to(device))).cpu() for x, _, _ in loader]).numpy()
    return 100 * np.mean([average_precision_score(split.labels[:, c], scores[:, c]) for c in range(scores.shape[1])])


def time_reference(path: Path, loss_name: str, epochs: int, measured_epochs: int, device) -> float:
    """The reference loop over the default grid; seconds per config extrapolated from `measured_epochs`."""
    features = cache.load(path)
    num_classes = len(features.classes)
    total = 0.0
    for lr in GRID_LRS:
        for batch_size in GRID_BATCH_SIZES:
            start = time.perf_counter()
            torch.manual_seed(0)
            model = torch.nn.Linear(FEATURE_DIM, num_classes).to(device)
            loss = losses.build(loss_name, num_classes=num_classes, dataset=features.dataset,
                                train_observed=features.train.observed).to(device)
            groups = [{"params": model.parameters()}]
            groups += [{"params": [p], "lr": lr * getattr(p, "lr_mult", 1.0)} for p in loss.parameters()]
            optimiser = torch.optim.Adam(groups, lr=lr)
            train = torch.utils.data.DataLoader(
                PerSampleFeatures(features.train.features, features.train.observed), batch_size=batch_size,
                shuffle=True,
            )
            for epoch in range(1, measured_epochs + 1):
                loss.start_epoch(epoch, epochs)
                for x, observed, index in train:
                    value = loss(model(x.to(device)), observed.to(device), index=index.to(device))
                    optimiser.zero_grad()
                    value.backward()
                    optimiser.step()
                reference_map(model, features.val, batch_size, device)
                reference_map(model, features.test, batch_size, device)
            total += (time.perf_counter() - start) * epochs / measured_epochs
    return total


def compile_rounds(path: Path, loss: str, args, folder: Path) -> list[dict]:
    """`--compile N`: `linear --loss LOSS` N times eager and N times with --compile, interleaved; the first compiled
    run with an empty inductor cache (cold), the others with the one it filled (warm)."""
    import torch._dynamo

    from spml_cache.linear import compiled

    compiled.MIN_STEPS = 0  # every stack, whatever its step count (forked workers inherit it)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor-cache")  # empty: the first compile is cold
    rows = []
    for round_ in range(args.compile):
        for compile_steps in (False, True):
            torch._dynamo.reset()  # nothing compiled in this process carries over to the next run
            seconds, results, printed = time_linear(path, loss, args.epochs, args.device, folder / "runs",
                                                    compile_steps=compile_steps)
            lines = [line for line in printed.splitlines() if line.startswith("compiled the")]
            best = {n: round(r["test_map"], 2) for n, r in results["losses"].items() if r.get("selected")}
            label = f"linear --loss {loss}" + (" --compile" if compile_steps else "")
            cold = " (cold)" if compile_steps and round_ == 0 else " (warm)" if compile_steps else ""
            heads = sum(len(r["configs"]) for r in results["losses"].values())
            rows.append({"run": label + cold, "loss": loss, "path": "compiled" if compile_steps else "eager",
                         "heads": heads, "round": round_ + 1, "seconds": round(seconds, 2), "compile_lines": lines,
                         "test_map": best, "load_average": round(os.getloadavg()[0], 2)})
            print(f"round {round_ + 1}: {label}{cold}: {seconds:.1f} s; {'; '.join(lines)}; test mAP {best};"
                  f" load {os.getloadavg()[0]:.1f}", flush=True)
    return rows


def cpu_name() -> str:
    """The CPU's model name (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="voc")
    parser.add_argument("--losses", default="an,role,all", help="what to time: loss names and/or all (comma list)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eager", action="store_true", help="on a GPU, also time each run with --no-graphs")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--reference-epochs", type=int, default=2)
    parser.add_argument("--no-reference", action="store_true", help="skip the reference loop")
    parser.add_argument("--reference-loss", default="an")
    parser.add_argument("--sweep", action="append", default=[], help="time LOSS.KEY=V1,V2,... (repeatable)")
    parser.add_argument("--hp-grid", default=None, help="paper: every timed run sweeps the papers' grids")
    parser.add_argument("--observe", default=None, help="also time every run under these observation rules")
    parser.add_argument("--fidelity", choices=["exact", "authors"], default=None, help="time under these rules")
    parser.add_argument("--compile", type=int, default=0, metavar="N",
                        help="time each run N times without and with --compile, interleaved (every stack compiled)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here as JSON")
    args = parser.parse_args()
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    load_before = os.getloadavg()
    print(f"device {device} ({name}), torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()}"
          f" torch threads, load average {load_before[0]:.1f}", flush=True)
    paths = ["graphs", "eager"] if device.type == "cuda" and args.eager else ["graphs" if device.type == "cuda" else "eager"]
    runs = [(loss, None) for loss in args.losses.split(",") if loss]
    for sweep in args.sweep:
        key, _, values = sweep.partition("=")
        runs.append((key.split(".")[0], {key: [float(v) for v in values.split(",")]}))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        path = synthetic_cache(Path(folder), args.shape)
        print(f"{args.shape}-shaped cache written in {time.perf_counter() - start:.1f} s", flush=True)
        variants = [None] + ([args.observe] if args.observe else [])  # single alone, then the rules
        for loss, hparams in runs if args.compile else []:
            rows += compile_rounds(path, loss, args, Path(folder))
            write_json(args, device, name, load_before, rows)
        for loss, hparams in runs if not args.compile else []:
            for way, observe in [(way, observe) for way in paths for observe in variants]:
                seconds, results, _ = time_linear(path, loss, args.epochs, args.device, Path(folder) / "runs",
                                                  hparams, args.hp_grid, graphs=way == "graphs", seeds=args.seeds,
                                                  observe=observe, fidelity=args.fidelity)
                heads = sum(len(r["configs"]) for r in results["losses"].values())
                label = f"linear --loss {loss}" + "".join(f" --hp {k}={','.join(map(str, v))}" for k, v in
                                                          (hparams or {}).items())
                label += (f" --hp-grid {args.hp_grid}" if args.hp_grid else "") + (" --no-graphs" if way == "eager" and
                                                                                     device.type == "cuda" else "")
                label += f" --observe {observe}" if observe else ""
                label += f" --fidelity {args.fidelity}" if args.fidelity else ""
                target = TARGETS.get((args.shape, loss)) if way == "graphs" and not hparams and args.seeds == 1 else None
                target = None if observe or args.fidelity == "authors" else target
                rows.append({"run": label, "loss": loss, "path": way, "heads": heads, "seconds": round(seconds, 2),
                             "target_s": target, "meets_target": None if target is None else seconds <= target})
                if observe:  # the bound: every rule at most as long as one rule alone, so N rules <= N x
                    rows[-1]["times_one_rule"] = round(seconds / rows[-2]["seconds"], 2)
                    rows[-1]["bound"] = len(parse_rules(observe))
                best = {n: round(r["test_map"], 1) for n, r in results["losses"].items() if r.get("selected")}
                print(f"{label}: {seconds:.1f} s, {heads} heads; test mAP {best if len(best) <= 3 else '...'}",
                      flush=True)
                write_json(args, device, name, load_before, rows)
        if not args.no_reference:
            seconds = time_reference(path, args.reference_loss, args.epochs, args.reference_epochs, device)
            rows.append({"run": f"reference loop, {args.reference_loss} grid (extrapolated)", "loss": args.reference_loss,
                         "path": "reference", "heads": 8, "seconds": round(seconds, 2)})
            print(f"reference: {seconds:.1f} s", flush=True)
    print(f"\n| {args.shape}-shaped, {args.epochs} epochs, 8 configs, {args.seeds} seed(s), {name} | seconds | target |")
    print("|---|---|---|")
    for row in rows:
        target = row.get("target_s")
        target = f"{row['times_one_rule']}x one rule (bound {row['bound']}x)" if "bound" in row else target
        print(f"| {row['run']} ({row['heads']} heads) | {row['seconds']:.1f} | {'' if target is None else target} |")
    print(f"load average before / after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f}")
    write_json(args, device, name, load_before, rows)


def write_json(args, device, name: str, load_before, rows: list[dict]) -> None:
    """The figures so far into `--json` (if given), replacing what an earlier call wrote."""
    if args.json is None:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    partial = args.json.with_name(args.json.name + ".partial")
    partial.write_text(json.dumps({
        "script": "scripts/bench_linear.py", "argv": sys.argv[1:], "device": str(device), "device_name": name,
        "cpus": os.cpu_count(), "torch": torch.__version__, "shape": args.shape, "epochs": args.epochs,
        "seeds": args.seeds, "configs": 8, "load_average": [load_before[0], os.getloadavg()[0]], "runs": rows,
        "observe": args.observe, "fidelity": args.fidelity or "exact",
    }, indent=2) + "\n")
    partial.replace(args.json)  # whole or not at all


if __name__ == "__main__":
    main()
