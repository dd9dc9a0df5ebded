"""The operations one stage-two training step runs, per loss, and how long a step takes (eager, this device).

A step is `HeadStack.train_step` as `spml-cache linear` runs it: the batch's rows gathered, every head's logits,
the loss and its gradient with respect to the logits, the heads' gradient and their Adam update. Each aten op it
dispatches is recorded (`spml_cache.runtime.step_trace.record`, the recorder the graph-safety tests and
`check-loss` use: what a captured CUDA graph would replay, one launch per kernel) and put in one part of the step
by where in the code it was called:

- forward: the batch (rows, labels), the logits and the loss's value;
- backward: the loss's gradient with respect to the logits (and its own parameters) by autograd; a loss that
  states its gradient in closed form (`Loss.loss_and_grad`) computes value and gradient in one pass, counted as
  forward (its backward is 0);
- optimiser: the heads' gradient, Adam on the heads and on the loss's own parameters (ROLE's theta).

`ops` counts every aten op the dispatcher sees; `kernels` leaves out the ops that only make a view or an alias
of a tensor (no kernel runs: `view`, `transpose`, `expand`, `detach`, ...), which is what a GPU launches.

The step traced is a full batch of the papers' smaller batch size (8) in epoch 2 (every loss's phases on: the
large-loss rejections, SPLC's correction), after a warm-up step; a loss's step runs the same ops in every epoch
(docs/internals.md, "Graph-safe steps"). Timing: `--time-steps` consecutive steps of that stack, median of
`--repeats`, one thread, denormals flushed (as `linear` trains on the CPU). The data is synthetic and VOC-shaped
(4,574 training rows, 2,048-d, 20 classes, 4 heads: the papers' four learning rates); the op counts do not depend
on the sizes.

`--compiled` times each loss's step eagerly and compiled (`linear --compile`: `HeadStack.gradients` by inductor,
linear/compiled.py), the two alternating `--repeats` times, beside the compile's seconds (cold where inductor's
cache, TORCHINDUCTOR_CACHE_DIR, is empty) and the steps it takes to pay it back.

`--against DIR --rounds N` compares this checkout with another (DIR: a checkout of the package, e.g. `git
worktree add /tmp/main main`): N rounds, each running this script on DIR's code and then on this one's in child
processes (`--code`), so that the machine's drift hits both alike; the JSON then holds both sides' counts and
each loss's median time of the N rounds.

Usage: python scripts/bench_step_ops.py [--losses an,role | all] [--time-steps 200] [--repeats 3]
       [--json docs/benchmarks/NAME.json] [--markdown] [--against DIR --rounds 3] [--code DIR] [--compiled]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]
# `--code DIR`: the checkout whose spml_cache is measured (before anything imports it); default this script's
CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv[:-1] else HERE
sys.path.insert(0, str(CODE))

from spml_cache import losses  # noqa: E402
from spml_cache.linear.data import LinearData  # noqa: E402
from spml_cache.linear.engine import SeedGrid, SeedRun  # noqa: E402
from spml_cache.protocol import GRID_LRS, observe_labels  # noqa: E402
from spml_cache.runtime.devices import flushing_denormals, single_threaded  # noqa: E402
from spml_cache.runtime.step_trace import HostReads, KernelHostReads, StepRecorder  # noqa: E402

SHAPE = {"train": 4574, "eval": 64, "dim": 2048, "classes": 20}  # VOC's training rows, width and classes
BATCH_SIZE, EPOCHS = 8, 25
PARTS = ("forward", "backward", "optimiser")
# ops that make a view or an alias of their input (or read its metadata): no kernel runs for them
VIEW_OPS = {
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten._reshape_alias", "aten.t", "aten.transpose",
    "aten.permute", "aten.expand", "aten.unsqueeze", "aten.squeeze", "aten.detach", "aten.alias", "aten.select",
    "aten.slice", "aten.as_strided", "aten.unbind", "aten.split", "aten.split_with_sizes", "aten.diagonal",
    "aten.expand_as", "aten.view_as", "aten.lift_fresh", "aten.unfold", "aten.narrow", "aten.flatten",
    "aten.unflatten", "aten.movedim", "aten.numpy_T", "aten.real", "aten.imag",
}
# the functions whose ops are the optimiser's (the heads' gradient and every Adam update) ...
OPTIMISER_FUNCTIONS = {("head_matrix.py", "step"), ("head_matrix.py", "take_gradient"), ("head_matrix.py", "update"),
                       ("adam.py", "step"), ("adam_kernel.py", "adam_update")}
# ... and those whose ops are the loss's gradient: autograd's engine, a closed form's gradient part
BACKWARD_FUNCTIONS = {("graph.py", "_engine_run_backward")}


class PartRecorder(StepRecorder):
    """The step recorder, noting for each op the part of the step that called it (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.parts.append(part_of(traceback.extract_stack()))
        return super().__torch_dispatch__(func, types, args, kwargs)


def part_of(stack) -> str:
    """The part of a step a call stack is in: the outermost marked function decides."""
    for frame in stack:
        where = (Path(frame.filename).name, frame.name)
        if where in OPTIMISER_FUNCTIONS:
            return "optimiser"
        if where in BACKWARD_FUNCTIONS or "backward" in frame.name and "autograd" in frame.filename:
            return "backward"
    return "forward"


def synthetic_data(seed: int = 0) -> LinearData:
    """VOC-shaped training rows in memory (features, full labels, single positives, a text side); a few eval rows."""
    generator = torch.Generator().manual_seed(seed)
    rows, dim, classes = SHAPE["train"], SHAPE["dim"], SHAPE["classes"]
    labels = (torch.rand(rows, classes, generator=generator) < 0.08).to(torch.uint8)
    labels[torch.arange(rows), torch.randint(0, classes, (rows,), generator=generator)] = 1
    observed = torch.from_numpy(observe_labels(labels.numpy()))
    features = torch.relu(labels.float() @ torch.randn(classes, dim, generator=generator) * 0.08
                          + torch.randn(rows, dim, generator=generator))
    eval_labels = (torch.rand(SHAPE["eval"], classes, generator=generator) < 0.2).to(torch.uint8)
    return LinearData(
        train_features=features, train_observed=observed, train_labels=labels,
        eval_features=torch.randn(2 * SHAPE["eval"], dim, generator=generator), num_val=SHAPE["eval"],
        val_targets=eval_labels, test_labels=eval_labels, dataset="voc",
        train_similarity=torch.rand(rows, classes, generator=generator) * 0.3,
    )


def stack_in_epoch_two(name: str, data: LinearData):
    """One loss's batch-8 stack of the papers' four lrs, trained a little into epoch 2; and the epoch's order."""
    run = SeedRun(name, {}, 0, SeedGrid(list(GRID_LRS), [BATCH_SIZE], EPOCHS), data)
    stack = run.stacks[0]
    for epoch in (1, 2):
        order = run.permutations[epoch - 1]
        stack.start_epoch(epoch, EPOCHS, order, data)
        stack.train_step(order[:BATCH_SIZE], data)  # the warm-up of the shape (a loss may make buffers there)
    return stack, order


def count_ops(name: str, data: LinearData) -> dict:
    """The ops of one step of loss `name`, per part, and the ops by name."""
    with single_threaded(data.device), flushing_denormals(data.device):
        stack, order = stack_in_epoch_two(name, data)
        rows = order[BATCH_SIZE : 2 * BATCH_SIZE]  # the engine cuts an epoch's batches at its start, not per step
        recorder = PartRecorder()
        with ExitStack() as recording:  # as step_trace.record, with this recorder
            recording.enter_context(KernelHostReads(recorder))
            recording.enter_context(HostReads(recorder.forbidden))
            recording.enter_context(recorder)
            stack.train_step(rows, data)
    if recorder.forbidden:
        raise SystemExit(f"{name}: the step syncs with the host: {recorder.forbidden[0]}")
    row = {"loss": name, "closed_form": getattr(stack, "closed_form", False)}
    names = [entry[0].split(".")[0] + "." + entry[0].split(".")[1] for entry in recorder.trace]
    for part in PARTS:
        in_part = [op for op, where in zip(names, recorder.parts) if where == part]
        row[part] = len(in_part)
        row[f"{part}_kernels"] = sum(op not in VIEW_OPS for op in in_part)
    row["ops"] = len(names)
    row["kernels"] = sum(op not in VIEW_OPS for op in names)
    by_op: dict[str, int] = {}
    for op in names:
        by_op[op] = by_op.get(op, 0) + 1
    row["by_op"] = dict(sorted(by_op.items(), key=lambda item: -item[1]))
    return row


def time_steps(name: str, data: LinearData, steps: int, repeats: int) -> float:
    """Microseconds per step, median of `repeats` runs of `steps` consecutive steps (eager, one thread)."""
    with single_threaded(data.device), flushing_denormals(data.device):
        stack, order = stack_in_epoch_two(name, data)
        starts = [(BATCH_SIZE * (1 + i)) % (len(order) - BATCH_SIZE) for i in range(steps)]
        batches = [order[start : start + BATCH_SIZE] for start in starts]
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            for rows in batches:
                stack.train_step(rows, data)
            times.append((time.perf_counter() - begin) / steps * 1e6)
    return statistics.median(times)


def time_compiled(name: str, data: LinearData, steps: int, repeats: int) -> dict:
    """`--compiled`: us per step eager and compiled (medians of `repeats`, alternating), the compile's seconds."""
    from spml_cache.linear.compiled import CompiledStep, CompileTime

    with single_threaded(data.device), flushing_denormals(data.device):
        stack, order = stack_in_epoch_two(name, data)
        if not stack.closed_form:
            return {"loss": name, "compiled": False}
        starts = [(BATCH_SIZE * (1 + i)) % (len(order) - BATCH_SIZE) for i in range(steps)]
        batches = [order[start : start + BATCH_SIZE] for start in starts]
        spent, eager = CompileTime(name), None
        compiled = CompiledStep(stack, spent)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(repeats):
            for way in times:
                stack.compiled = None if way == "eager" else compiled
                begin = time.perf_counter()
                for rows in batches:
                    stack.train_step(rows, data)
                times[way].append((time.perf_counter() - begin) / steps * 1e6)
        eager, fused = statistics.median(times["eager"]), statistics.median(times["compiled"][1:] or times["compiled"])
    saved = eager - fused
    return {"loss": name, "compiled": True, "compile_s": round(spent.seconds, 2), "graphs": spent.graphs,
            "us_eager": round(eager, 1), "us_compiled": round(fused, 1),
            "steps_to_pay": round(spent.seconds / (saved * 1e-6)) if saved > 0 else None}


def markdown(rows: list[dict]) -> str:
    lines = ["| loss | ops (kernels) | forward | backward | optimiser | us per step |", "|---|---|---|---|---|---|"]
    for row in rows:
        parts = " | ".join(f"{row[part]} ({row[f'{part}_kernels']})" for part in PARTS)
        timed = f"{row['us_per_step']:.0f}" if row.get("us_per_step") else ""
        closed = " (closed form)" if row["closed_form"] else ""
        lines.append(f"| `{row['loss']}`{closed} | {row['ops']} ({row['kernels']}) | {parts} | {timed} |")
    ops = statistics.median(row["ops"] for row in rows)
    kernels = statistics.median(row["kernels"] for row in rows)
    lines.append(f"| median of {len(rows)} losses | {ops:g} ({kernels:g}) | | | | |")
    return "\n".join(lines)


def compare_compiled(args) -> None:
    """`--compiled`: per loss, its step eager and compiled; a markdown table and (`--json`) the figures."""
    names = losses.names() if args.losses == "all" else args.losses.split(",")
    data = synthetic_data()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for name in names:
        rows.append(time_compiled(name, data, args.time_steps, args.repeats))
        print(rows[-1], f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print("| loss | compile (s) | us per step eager | compiled | steps to pay the compile back |")
    print("|---|---|---|---|---|")
    for row in rows:
        if row["compiled"]:
            pay = f"{row['steps_to_pay']:,}" if row["steps_to_pay"] else "never (no faster)"
            print(f"| `{row['loss']}` | {row['compile_s']:.1f} | {row['us_eager']:.0f} | {row['us_compiled']:.0f} | {pay} |")
    if args.json:
        write_json(args.json, {**run_header(), "load_average": os.getloadavg()[0], "losses": rows})



def run_header() -> dict:
    """What every JSON this script writes says first: the script, its arguments, torch, the device it ran on and
    the step measured."""
    from bench_linear import cpu_name  # scripts/ is on the path of a script run from it

    return {"script": "scripts/bench_step_ops.py", "argv": sys.argv[1:], "torch": torch.__version__,
            "device": "cpu", "device_name": cpu_name(), "cpus": os.cpu_count(), "shape": SHAPE,
            "batch_size": BATCH_SIZE, "heads": len(GRID_LRS)}

def compare(args) -> None:
    """`--against`: rounds of the other checkout's code then this one's, each in a child process; both sides'
    counts (the first round's) and each loss's median time into one JSON."""
    sides = {"before": args.against.resolve(), "after": args.code.resolve()}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for side, code in sides.items():
                out = Path(folder) / f"{side}-{round_}.json"
                subprocess.run([sys.executable, str(Path(__file__).resolve()), "--code", str(code), "--losses",
                                args.losses, "--time-steps", str(args.time_steps), "--repeats", str(args.repeats),
                                "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
                runs[side].append(json.loads(out.read_text()))
                print(f"round {round_ + 1}: {side} ({code}) done, load average {os.getloadavg()[0]:.1f}", flush=True)
    table = []
    for first in runs["after"][0]["losses"]:
        name, row = first["loss"], {"loss": first["loss"]}
        for side, side_runs in runs.items():
            rows = [next(r for r in run["losses"] if r["loss"] == name) for run in side_runs]
            row.update({f"{key}_{side}": rows[0][key] for key in ("ops", "kernels", *PARTS, "closed_form")})
            if args.time_steps:
                row[f"us_{side}"] = statistics.median(r["us_per_step"] for r in rows)
        table.append(row)
    summary = {f"median_{key}_{side}": statistics.median(row[f"{key}_{side}"] for row in table)
               for key in ("ops", "kernels") + (("us",) if args.time_steps else ()) for side in sides}
    for key, value in summary.items():
        print(f"{key}: {value:g}")
    if args.markdown:
        print(compared_markdown(table, bool(args.time_steps)))
    if args.json:
        write_json(args.json, {**run_header(), "rounds": args.rounds, "code": {k: str(v) for k, v in
                                                                                         sides.items()},
                               "load_averages": {side: [run["load_average"] for run in side_runs]
                                                 for side, side_runs in runs.items()},
                               **summary, "losses": table})


def compared_markdown(table: list[dict], timed: bool) -> str:
    """`compare`'s table: each part's ops (kernels) before -> after, and the step's time."""
    lines = ["| loss | ops (kernels) | forward | backward | optimiser |" + (" us per step |" if timed else ""),
             "|---|---|---|---|---|" + ("---|" if timed else "")]
    for row in table:
        cells = [f"{row['ops_before']} ({row['kernels_before']}) -> {row['ops_after']} ({row['kernels_after']})"]
        cells += [f"{row[f'{part}_before']} -> {row[f'{part}_after']}" for part in PARTS]
        cells += [f"{row['us_before']:.0f} -> {row['us_after']:.0f}"] if timed else []
        closed = " (closed form)" if row["closed_form_after"] else ""
        lines.append(f"| `{row['loss']}`{closed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, content: dict) -> None:
    """`content` into `path`, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(content, indent=2) + "\n")
    partial.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", default="all", help="loss names (comma list), or all")
    parser.add_argument("--time-steps", type=int, default=200, help="steps timed per loss (0: count ops only)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the table here as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--code", type=Path, default=HERE, help="the checkout whose code is measured")
    parser.add_argument("--against", type=Path, default=None, help="another checkout to compare with, interleaved")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: rounds of both")
    parser.add_argument("--compiled", action="store_true", help="time each step eager and compiled (inductor)")
    args = parser.parse_args()
    if args.against:
        return compare(args)
    if args.compiled:
        return compare_compiled(args)
    names = losses.names() if args.losses == "all" else args.losses.split(",")
    data = synthetic_data()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for name in names:
        row = count_ops(name, data)
        if args.time_steps:
            row["us_per_step"] = round(time_steps(name, data, args.time_steps, args.repeats), 1)
        rows.append(row)
        print(f"{name:>13}: {row['ops']:4d} ops ({row['kernels']} kernels): " + ", ".join(
            f"{part} {row[part]}" for part in PARTS) + (f"; {row['us_per_step']:.0f} us a step" if args.time_steps
                                                        else ""), flush=True)
    if args.markdown:
        print(markdown(rows))
    if args.json:
        write_json(args.json, {
            **run_header(),
            "load_average": os.getloadavg()[0], "median_ops": statistics.median(row["ops"] for row in rows),
            "median_kernels": statistics.median(row["kernels"] for row in rows), "losses": rows,
        })


if __name__ == "__main__":
    main()
