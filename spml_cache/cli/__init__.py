"""The `spml-cache` command: parses flags, calls one function per command, prints with rich.

Every command's work lives in its module; this file only turns flags into arguments and results into
tables. Errors a user can fix arrive as `SpmlError` and leave as one red line (exit 1); `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.text import Text

from spml_cache import backbones
from spml_cache.cli.text import (  # noqa: F401 (parse_* are the command line's API, tested as cli.parse_*)
    CONSOLE as console,
    DATASETS_HELP,
    RULES_HELP,
    default_data_root,
    extract_report,
    finetune_summary,
    last_line,
    no_type_for_flags,
    one_line_warning,
    parse_hparams,
    parse_list,
    parse_names,
    require_root,
)
from spml_cache.cli.check_loss import check_loss_command
from spml_cache.cli.tools import (
    datasets_command,
    demo_command,
    export_command,
    import_features_command,
    losses_command,
    make_demo_data_command,
    report_command,
)
from spml_cache.cli.stopping import exit_code, stopping_on_signals
from spml_cache.runtime.errors import Interrupted, SpmlError, stop_requested, work_finished
from spml_cache.runtime.install import mismatched_torchvision

app = typer.Typer(
    name="spml-cache",
    help="Single-positive multi-label learning on a cached ResNet-50 feature matrix.\n\n"
    "Example: spml-cache demo",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
_debug = {"on": bool(os.environ.get("SPML_DEBUG"))}


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback on errors."),
) -> None:
    if debug:
        _debug["on"] = True


# --- datasets, make-demo-data (datasets helper) ---
app.command("datasets")(datasets_command)
app.command("make-demo-data")(make_demo_data_command)


# --- extract, import-features (extract helper) ---


@app.command("extract")
def extract_command(
    dataset: str = typer.Argument(..., help=f"{DATASETS_HELP}."),
    root: Optional[Path] = typer.Option(None, "--root", help="The dataset's folder (default: $SPML_DATA)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Cache file (default: $SPML_CACHE or ./cache, <dataset>-<backbone>-<R>.h5, the backbone's - : / as _)."),
    backbone: str = typer.Option(backbones.DEFAULT, "--backbone", help="resnet50 (the papers'), resnet101, vit_b_16, convnext_base or another torchvision model; timm:NAME; clip:ARCH/TAG; your own module:callable, path/to/file.py:callable or spml_cache.backbones entry point (docs/your-own-backbone.md)."),
    weights: Optional[str] = typer.Option(None, "--weights", help="resnet50: IMAGENET1K_V1 (default, the papers'), IMAGENET1K_V2; torchvision: an enum name (default DEFAULT); timm: pretrained (default) or a tag; clip: a tag (default: the name's); any: a local .pth, or none (random)."),
    resolution: Optional[int] = typer.Option(None, "--resolution", help="The input side R (default: 448 for resnet50, squashed to R x R; else the backbone's own, resized and centre-cropped)."),
    clip_features: str = typer.Option(backbones.DEFAULT_CLIP_FEATURES, "--clip-features", help="clip: post (after the projection, CLIP's README) or pre (before it, the CLIP paper's probes)."),
    prompts: str = typer.Option(backbones.DEFAULT_PROMPTS, "--prompts", help="clip: the text templates, default ('a photo of a {}.'), vlpl, or a file with one template per line."),
    crops: int = typer.Option(0, "--crops", help="clip: also the embeddings of a G x G grid of crops of each image (G >= 2; GPR's crop pseudo-labels)."),
    features: str = typer.Option(backbones.DEFAULT_FEATURES, "--features", help="pooled (the pooled vector) or last4: a ViT's last four blocks' class tokens and last block's mean patch token, a CNN's last four stages average-pooled, concatenated (DINOv2's linear evaluation); the kind names the cache."),
    batch_size: int = typer.Option(64, "--batch-size", help="Images per forward pass."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Loader processes (default: 8 on a GPU, cores/4 on the CPU)."),
    device: str = typer.Option("auto", "--device", help="auto, cuda, cuda:N or cpu."),
    precision: str = typer.Option("auto", "--precision", help="auto (fp16 on a GPU, fp32 on the CPU), fp32, fp16 or bf16."),
    decode: Optional[str] = typer.Option(None, "--decode", help="gpu (nvjpeg; the default on a GPU) or cpu (libjpeg-turbo in the loader workers: the CPU's pixels, as the papers' PIL within a level; docs/fidelity.md)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N images of each split (protocol drawn on the full dataset)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print counts, missing files and the output size; write nothing."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if a cache or partial file with these or other settings exists."),
    on_bad_image: str = typer.Option("fail", "--on-bad-image", help="fail (name the file and stop) or skip (leave the image out, listed in the attrs)."),
    skip_missing: bool = typer.Option(False, "--skip-missing", help="Leave out images whose file is missing (recorded in the attrs)."),
    observe: Optional[str] = typer.Option(None, "--observe", help=f"Observation rules to store beside single, a comma list: {RULES_HELP} (docs/protocol.md); a complete cache gets the ones it lacks."),
    labels: Optional[str] = typer.Option(None, "--labels", help="How the cache stores its label matrices: auto (the default: sparse CSR from 1,000 classes), dense or sparse."),
) -> None:
    """Stage one: run a frozen backbone (ResNet-50 by default) over a dataset once and write its features to an
    HDF5 cache; a clip:ARCH/TAG backbone also writes its image embeddings and the class prompts' text embeddings.

    An interrupted run resumes from <out>.partial; a complete cache is not recomputed unless --force. Under
    torchrun --nproc-per-node N -m spml_cache extract ..., each process extracts every N-th row and rank 0 joins
    them into the one cache.

    Example: spml-cache extract voc --root ~/data --observe entry:0.1,largest
    Example: spml-cache extract voc --root ~/data --features last4
    """
    from spml_cache.observation import parse_rules

    rules = None if observe is None else parse_rules(observe)  # before the heavy imports: a typo fails at once
    from spml_cache.extract import ExtractOptions, run_extract

    report = run_extract(ExtractOptions(
        dataset, require_root(root), out=out, backbone=backbone, weights=weights, resolution=resolution,
        clip_features=clip_features, prompts=prompts, crops=crops, features=features, batch_size=batch_size,
        workers=workers, device=device, precision=precision, decode=decode, limit=limit, dry_run=dry_run, force=force,
        on_bad_image=on_bad_image, skip_missing=skip_missing, observe=rules, labels=labels,
    ))
    if report is not None:  # under torchrun, rank 0 reports for every process
        extract_report(report, console)


app.command("import-features")(import_features_command)
app.command("export")(export_command)


# --- losses (losses helper) ---
app.command("losses")(losses_command)


app.command("check-loss")(check_loss_command)


# --- linear, demo (linear helper) ---


@app.command("linear")
def linear_command(
    loss: Optional[str] = typer.Option(None, "--loss", help="A loss, a comma list (an,role), or all; see `spml-cache losses`."),
    cache: Optional[Path] = typer.Option(None, "--cache", help="The feature cache (.h5) to train on."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Train on the one cache of this dataset in $SPML_CACHE or ./cache."),
    lr: Optional[str] = typer.Option(None, "--lr", help="Learning rates, a comma list (default: the papers' grid)."),
    wd: Optional[str] = typer.Option(None, "--wd", help="The probe's L2 weight decays, a comma list (e.g. 0,1e-4,1e-3): one head per (lr, wd) in the same stacks, selected on val (default: 0, the papers' grid)."),
    batch_size: Optional[str] = typer.Option(None, "--batch-size", help="Batch sizes, a comma list (default: the papers' grid)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Epochs per head; the best val epoch is selected (default: the papers' number)."),
    seeds: Optional[int] = typer.Option(None, "--seeds", help="Run seeds 0..N-1 (init and batch order); results are mean ± std (default: one seed)."),
    hp: Optional[List[str]] = typer.Option(None, "--hp", help="A hyperparameter key=value (repeatable); loss.key=value for one loss; key=v1,v2,... sweeps the values."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    out: Optional[Path] = typer.Option(None, "--out", help="Runs folder: writes <out>/<dataset>/linear-<loss>-<time>/ (default: runs)."),
    val_labels: Optional[str] = typer.Option(None, "--val-labels", help="Select on clean (full) val labels, the default, or on the observed ones."),
    workers: int = typer.Option(0, "--workers", help="Processes training (loss, seed, batch size) jobs in parallel; 0: one per core on the CPU when the grid is big."),
    from_run: Optional[Path] = typer.Option(None, "--from", help="Start every head from this linear run's head of the same loss (else its best single-positive head)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Go on with the interrupted linear run RUN: train only what it has not kept, with its own settings (a flag beside it that contradicts them is refused)."),
    fidelity: Optional[str] = typer.Option(None, "--fidelity", help="exact (default): the papers' math, computed stably; authors: their code's numerics, dropped last batches and early stopping (docs/fidelity.md)."),
    hp_grid: Optional[str] = typer.Option(None, "--hp-grid", help="paper: sweep each loss's own search space where its paper states one (spml-cache losses lists them); --hp values win."),
    no_graphs: bool = typer.Option(False, "--no-graphs", help="On a GPU, train the stacks one by one, eagerly, instead of all at once as replayed CUDA graphs (for debugging; same results up to float rounding)."),
    observe: Optional[str] = typer.Option(None, "--observe", help=f"Observation rules, a comma list (default single; {RULES_HELP}): every loss trains under each; rules the cache lacks are drawn from its full labels (docs/protocol.md)."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", help="Memory stage two may use, e.g. 1GB (default: 80% of the device's free memory); features beyond it stream from the cache in a seeded chunk order planned from the budget and the cache's shapes (docs/protocol.md)."),
    chunk_rows: Optional[int] = typer.Option(None, "--chunk-rows", help="Stream the train features in chunks of N rows whatever the budget: the same chunk order, and results, on any machine (docs/protocol.md)."),
) -> None:
    """Stage two: linear heads on cached features, every (lr, batch size) config at once; best val epoch, test mAP there.

    Every finished (loss, seed, batch size) is kept as it finishes: after Ctrl-C, --resume RUN goes on. A
    hyperparameter given as a comma list is swept, every value beside every lr and batch size.

    Example: spml-cache linear --dataset voc --loss an,ll_r --seeds 3
    Example: spml-cache linear --dataset voc --loss ll_r --hp delta=0.001,0.002
    Example: spml-cache linear --dataset voc --loss all --observe single,entry:0.1
    Example: spml-cache linear --dataset voc --loss all --wd 0,1e-4,1e-3
    """
    from spml_cache.observation import parse_rules
    from spml_cache.runtime.memory import parse_size

    rules = None if observe is None else parse_rules(observe)  # before the heavy imports: a typo fails at once
    budget = parse_size(memory_budget)
    from spml_cache.linear import LinearOptions, LinearPlacement, run_linear_options, summary_table

    if loss is None and resume is None:
        raise typer.BadParameter("missing: give a loss, a comma list or all (or --resume RUN)", param_hint="--loss")
    options = LinearOptions(  # what is not given is None: the defaults, or a resumed run's own settings
        cache=cache, dataset=dataset, losses=None if loss is None else parse_names(loss),
        lrs=None if lr is None else parse_list(lr, "--lr", float), epochs=epochs, seeds=seeds,
        wds=None if wd is None else parse_list(wd, "--wd", float),
        batch_sizes=None if batch_size is None else parse_list(batch_size, "--batch-size", int),
        val_labels=val_labels, hparams=parse_hparams(hp) if hp else None, from_run=from_run, resume=resume,
        fidelity=fidelity, hp_grid=hp_grid, observe=rules, memory_budget=budget, chunk_rows=chunk_rows,
    )
    run = run_linear_options(options, LinearPlacement(device=device, out=out, workers=workers, graphs=not no_graphs))
    if run is None:  # under torchrun, rank 0 reports for every process
        return
    console.print(summary_table(run.results))
    console.print(f"run directory: {escape(str(run.run_dir))}")


app.command("demo")(demo_command)


# --- finetune (finetune helper) ---


@app.command("finetune")
def finetune_command(
    init: Optional[str] = typer.Option(None, "--init", help="best: start from the best linear head (LinearInit, the default); imagenet: a fresh head."),
    from_run: Optional[Path] = typer.Option(None, "--from", help="Linear run to take the head from (default: the newest one for the dataset and loss under --out)."),
    cache_file: Optional[Path] = typer.Option(None, "--cache", help="Feature cache whose rows (ids, splits, observed labels) to fine-tune on (default: the linear run's)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Dataset name, to find its newest linear run and default cache."),
    root: Optional[Path] = typer.Option(None, "--root", help="Dataset root the cache was extracted from; images are read from ROOT/id (default: $SPML_DATA)."),
    loss: Optional[str] = typer.Option(None, "--loss", help="Loss to fine-tune with (spml-cache losses lists them); its head is the one taken; loss@rule (an@entry:0.1) takes its head under that observation rule, and trains on that rule's labels."),
    weights: Optional[str] = typer.Option(None, "--weights", help="Trunk init, for the cache's backbone: a weights tag (IMAGENET1K_V1, ...), none or a .pth (default: what made the cache); must match the cache for an exact LinearInit."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Epochs (default 10, or the loss's recipe: GR 8 on VOC/COCO)."),
    lr: Optional[str] = typer.Option(None, "--lr", help="Comma-separated learning rates, or 'grid' for 1e-2,1e-3,1e-4,1e-5 (default 1e-5,1e-4)."),
    batch_size: Optional[str] = typer.Option(None, "--batch-size", help="Comma-separated global batch sizes (default 8,16); shared by torchrun's processes."),
    resolution: Optional[int] = typer.Option(None, "--resolution", help="Images are resized to R x R (default: the cache's resolution)."),
    seeds: Optional[int] = typer.Option(None, "--seeds", help="Number of seeds (0..N-1) of batch order and flips (default 1)."),
    hp: Optional[List[str]] = typer.Option(None, "--hp", help="Loss hyperparameter override key=value (repeatable); default: the linear head's values."),
    head_lr_mult: Optional[float] = typer.Option(None, "--head-lr-mult", help="The head's learning rate multiplier (default 1; 10 for GR and LL, as their authors' code)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N (under torchrun: each process's own GPU)."),
    out: Path = typer.Option(Path("runs"), "--out", help="Runs folder: where linear runs are looked up and the fine-tuning run is written."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the interrupted fine-tuning run RUN from its last checkpoint."),
    skip_missing: bool = typer.Option(False, "--skip-missing", help="Leave out rows whose image is missing under --root instead of stopping."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Image reader processes (default: 8 on a GPU, fewer on a CPU)."),
    fidelity: Optional[str] = typer.Option(None, "--fidelity", help="exact (default): the papers' math, computed stably; authors: their code's numerics, evaluation and early stopping (docs/fidelity.md)."),
    decode: Optional[str] = typer.Option(None, "--decode", help="gpu (nvjpeg) or cpu (libjpeg-turbo in the reader processes); default: the cache's decoder, so that epoch 0 is the linear head."),
) -> None:
    """Stage three: fine-tune ResNet-50 end to end from the best linear head (LinearInit) or a fresh head.

    Images, splits and observed labels are the cache's rows. For data parallel, launch it with
    torchrun --nproc-per-node N -m spml_cache finetune ... (the global batch is shared by the processes).

    Example: spml-cache finetune --dataset voc --loss role --root ~/data --lr 1e-5
    """
    from spml_cache.finetune import FinetuneOptions, FinetuneRun, run_finetune
    from spml_cache.protocol import GRID_LRS

    lrs = None if lr is None else list(GRID_LRS) if lr == "grid" else parse_list(lr, "--lr", float)
    options = FinetuneOptions(
        init=init, from_run=from_run, cache=cache_file, dataset=dataset, loss=loss, weights=weights,
        resolution=resolution, epochs=epochs, lrs=lrs,
        batch_sizes=None if batch_size is None else parse_list(batch_size, "--batch-size", int), seeds=seeds,
        head_lr_mult=head_lr_mult, skip_missing=skip_missing or None, hparams=parse_hparams(hp or []),
        fidelity=fidelity, decode=decode,
    )
    run = FinetuneRun(device=device, out=out, resume=resume, workers=workers,
                      root=root if root is not None else (None if resume else default_data_root()))
    results = run_finetune(options, run,
                           log=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
    for line in finetune_summary(results):  # other torchrun processes return nothing
        console.print(line, soft_wrap=True)


# --- report (report helper) ---
app.command("report")(report_command)


def main() -> None:
    """Console-script entry point: run the app; a user error, Ctrl-C, SIGTERM and a warning each become one
    line (exit 1, 130, 143)."""
    before_separator = sys.argv[: sys.argv.index("--")] if "--" in sys.argv else sys.argv
    if "--debug" in before_separator[1:]:  # anywhere, not only before the command
        _debug["on"] = True
        sys.argv[:] = [arg for i, arg in enumerate(sys.argv) if not (arg == "--debug" and i < len(before_separator))]
    no_type_for_flags()
    with stopping_on_signals():
        try:
            with warnings.catch_warnings():
                warnings.showwarning = one_line_warning
                app()
        except Interrupted as stop:
            command = stop.command or shlex.join(["spml-cache", *sys.argv[1:]])
            last_line(Text(f"interrupted: {stop.kept}; go on with: {command}", style="yellow"), exit_code())
        except KeyboardInterrupt:
            last_line(Text("interrupted", style="yellow"), exit_code())
        except SystemExit as done:  # typer turns a KeyboardInterrupt it sees (one during an import) into exit 130
            if stop_requested() is None or work_finished() or not isinstance(done.__context__, typer.Exit):
                raise
            last_line(Text("interrupted", style="yellow"), exit_code())
        except SpmlError as err:
            if _debug["on"]:
                raise
            last_line(Text("error: ", style="bold red") + Text(str(err), style="red"), 1)
        except Exception as err:  # a bug or an environment failure: still one line unless --debug
            if _debug["on"]:
                raise
            known = mismatched_torchvision(err)  # a broken install, met as the command starts: the fix
            if known is not None:
                last_line(Text("error: ", style="bold red") + Text(str(known), style="red"), 1)
            message = f"{type(err).__name__}: {err} (run with --debug for the traceback)"
            last_line(Text("error: ", style="bold red") + Text(message, style="red"), 1)

