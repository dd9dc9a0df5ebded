"""`spml-cache demo`: the whole pipeline on a generated dataset, in one to two minutes on two CPU cores.

Writes, under the output folder: `data/` (a synthetic dataset in the PASCAL VOC 2012 layout), `cache/` (its
ResNet-50 features), `runs/` (stage two with every loss, and one epoch of stage three from the best
single-positive head) and `plots/` (the report's figures). ImageNet weights are used when torch already has them
cached; otherwise the trunk is random (the demo's images are drawn so that random features still separate the
classes) and a warning says so. Nothing is downloaded.
"""

from __future__ import annotations

import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from spml_cache import report
from spml_cache.backbones.checkpoints import RandomWeightsWarning
from spml_cache.backbones.resnet50 import checkpoint_path
from spml_cache.cache import default_path
from spml_cache.demo.data import make_demo_data
from spml_cache.extract import extract
from spml_cache.finetune import finetune
from spml_cache.linear import run_linear
from spml_cache.options.demo import DemoSizes
from spml_cache.runs import best_loss
from spml_cache.runtime.devices import resolve_device
from spml_cache.runtime.errors import SpmlError, more_work

TRUNK_SEED = 0  # a random trunk is drawn from torch's global generator: seed it, so the demo repeats
# Stage three, shown rather than converged: one epoch at the small lr LinearInit fine-tunes with.
FINETUNE = {"epochs": 1, "lrs": [1e-5], "batch_sizes": [8]}


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    out: Path
    weights: str
    cache: Path
    run_dir: Path
    plots: list[Path]
    results: dict


def demo_weights() -> str:
    """`IMAGENET1K_V1` when torch has it cached (no download), else `none`."""
    return "IMAGENET1K_V1" if checkpoint_path("IMAGENET1K_V1").is_file() else "none"


def _check_data_folder(data_root: Path) -> None:
    """Only a previous demo's data may be replaced: never a real dataset someone keeps there."""
    index = data_root / "VOCdevkit" / "VOC2012" / "ImageSets" / "Main" / "train.txt"
    if (data_root / "VOCdevkit").exists():
        first = index.read_text().split("\n", 1)[0] if index.is_file() else ""
        if not first.startswith("demo_"):
            raise SpmlError(f"{data_root / 'VOCdevkit'} is not demo data; pass another --out folder")


def run_demo(out: Path | str = "demo", sizes: DemoSizes = DemoSizes(), *, device: str = "auto",
             console: Console | None = None) -> DemoResult:
    """Generate the data, extract features, train every loss, print the tables, write the plots (`sizes`: checked
    by their declarations as they were built, before any work)."""
    console = console or Console()
    num_train, num_test, size, resolution = sizes.num_train, sizes.num_test, sizes.size, sizes.resolution
    epochs, lrs, batch_sizes = sizes.epochs, sizes.lrs, sizes.batch_sizes
    resolve_device(device)
    out = Path(out)
    data_root = out / "data"
    _check_data_folder(data_root)
    weights = demo_weights()
    if weights == "none":
        console.print("[yellow]warning: no ImageNet ResNet-50 weights in the torch cache; the demo uses a randomly "
                      "initialised trunk (its numbers are not the papers')[/yellow]")
    console.print(f"[bold]1/5[/bold] generating {num_train} + {num_test} demo images in {escape(str(data_root))}")
    make_demo_data(data_root, num_train=num_train, num_test=num_test, size=size, overwrite=True)
    console.print(f"[bold]2/5[/bold] extracting features (ResNet-50, weights {weights}, {resolution} px)")
    cache_path = default_path("voc", resolution, folder=out / "cache")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomWeightsWarning)  # said once above
        torch.manual_seed(TRUNK_SEED)
        extracted = extract("voc", data_root, out=cache_path, weights=weights, resolution=resolution,
                            device=device, force=True)
    more_work()  # each stage's door says its work is done: the demo's is not
    console.print(f"[bold]3/5[/bold] training linear heads with every loss ({escape(str(extracted.path))})")
    run = run_linear(cache=extracted.path, losses="all", lrs=lrs, batch_sizes=batch_sizes, epochs=epochs,
                     device=device, out=out / "runs", console=console)
    best = best_loss(run.results["losses"])
    if best is None:
        raise SpmlError("every single-positive loss diverged in the demo's linear stage: nothing to fine-tune")
    more_work()
    console.print(f"[bold]4/5[/bold] fine-tuning end to end from the best single-positive head ({escape(best)}), "
                  f"{FINETUNE['epochs']} epoch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomWeightsWarning)
        tuned = finetune(init="best", from_run=run.run_dir, loss=best, root=data_root, weights=weights,
                         device=device, out=out / "runs", workers=0,
                         log=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True),
                         **FINETUNE)
    more_work()
    console.print(f"[bold]5/5[/bold] report and plots ({escape(str(out / 'runs'))})")
    plots = _report([run.run_dir, Path(tuned["run_dir"])], out / "plots", console)
    result = DemoResult(out=out, weights=weights, cache=extracted.path, run_dir=run.run_dir, plots=plots,
                        results=run.results)
    for line in next_steps(result, best):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    return result


def next_steps(result: DemoResult, loss: str) -> list[str]:
    """The demo's last lines: where its cache, runs and figures are, and commands that go on from them when
    pasted in the folder the demo ran in (its own data has no `cache/` or `runs/` there: each names its folder)."""
    runs_dir = result.out / "runs"
    commands = [
        ["spml-cache", "linear", "--cache", str(result.cache), "--loss", loss, "--out", str(runs_dir)],
        ["spml-cache", "finetune", "--from", str(result.run_dir), "--loss", loss, "--root", str(result.out / "data"),
         "--out", str(runs_dir), "--epochs", str(FINETUNE["epochs"]), "--lr", ",".join(f"{lr:g}" for lr in FINETUNE["lrs"]),
         "--batch-size", ",".join(str(size) for size in FINETUNE["batch_sizes"])],
        ["spml-cache", "report", "--runs", str(runs_dir), "--plots", str(result.out / "plots")],
    ]
    return [
        f"cache: {result.cache}; runs: {runs_dir}" + (f"; plots: {result.plots[0].parent}" if result.plots else ""),
        "next, from this folder (or export SPML_CACHE=" + shlex.quote(str(result.cache.parent))
        + " and use --dataset voc in place of --cache):",
        *("  " + shlex.join(command) for command in commands),
    ]


def _report(run_dirs: list[Path], plots_dir: Path, console: Console) -> list[Path]:
    report.print_report(run_dirs, console=console)
    return report.write_plots(run_dirs, plots_dir, console=console)
