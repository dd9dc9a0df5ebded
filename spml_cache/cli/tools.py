"""The `spml-cache` commands around the three stages: the datasets found, demo data, features made elsewhere in
and out, the losses, the demo and the report. Each is a thin function, registered on the app in `cli/__init__.py`
in the order `--help` lists them."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from spml_cache.cli.text import (
    CONSOLE as console,
    PUBLISHED_HELP,
    default_data_root,
    parse_list,
)


def datasets_command(
    root: Optional[Path] = typer.Option(None, "--root", help="A data folder to look in (default: $SPML_DATA)."),
) -> None:
    """Supported datasets, the layout each expects and, given a root, what was found there or what is missing.

    A dataset may sit at the root itself or in root/<name> (e.g. $SPML_DATA/voc/VOCdevkit). A dataset that is
    found is read in full, so this takes as long as reading its annotations.

    Example: spml-cache datasets --root ~/data
    """
    from spml_cache import datasets

    root = root or default_data_root()
    console.print(datasets.survey_table(root))
    if root is None:
        console.print("[dim]pass --root DIR or set SPML_DATA to see what is found there[/dim]")


def make_demo_data_command(
    folder: Path = typer.Argument(..., help="Where to write the dataset (it will hold VOCdevkit/)."),
    num_train: int = typer.Option(400, "--train", help="Images in VOC's train set (our train + val)."),
    num_test: int = typer.Option(200, "--test", help="Images in VOC's val set (our test split)."),
    size: int = typer.Option(128, "--size", help="Image side in pixels."),
    seed: int = typer.Option(0, "--seed", help="Random seed of the drawing."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing FOLDER/VOCdevkit."),
) -> None:
    """Write a small synthetic dataset in the real PASCAL VOC 2012 layout: coloured shapes, 20 VOC classes.

    1-3 objects per image, each class its own (colour, shape) look, ~10% of objects "difficult" (flag 0).

    Example: spml-cache make-demo-data demo-data --train 400 --test 200
    """
    from spml_cache.demo.data import make_demo_data

    root = make_demo_data(folder, num_train=num_train, num_test=num_test, size=size, seed=seed, overwrite=overwrite)
    console.print(f"wrote {num_train} train + {num_test} test images ({size} px, VOC 2012 layout) under {escape(str(root))}")
    next_command = shlex.join(["spml-cache", "extract", "voc", "--root", str(root), "--weights", "none",
                               "--resolution", str(size)])
    console.print(f"[dim]next: {escape(next_command)}[/dim]")


def import_features_command(
    folder: Path = typer.Argument(..., help="Folder with the authors' formatted_*.npy and *_features_imagenet_resnet50.npy, or embeddings in the clip-retrieval layout (img_emb/img_emb_{i}.npy, metadata/metadata_{i}.parquet)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help=f"{PUBLISHED_HELP} (decides the image-id prefix; with the clip-retrieval layout, the dataset read under --root; an spml-cache export names its own)."),
    root: Optional[Path] = typer.Option(None, "--root", help="clip-retrieval layout from other tools: the dataset's folder, whose images the embedding rows are matched to by id or image_path (default: $SPML_DATA); an spml-cache export needs none."),
    out: Optional[Path] = typer.Option(None, "--out", help="Cache file (default: $SPML_CACHE or ./cache, <dataset>-resnet50-448.h5; clip-retrieval layout: <dataset>-<backbone>-<R>.h5, imported-0 when the folder does not say; never the cache an export was made from)."),
    classes: Optional[Path] = typer.Option(None, "--classes", help="Text file with the class names, one per line (VOC's are built in)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing cache at --out."),
) -> None:
    """Turn features computed elsewhere into a project cache: the authors' published features (their `val` = the
    official test split), or embeddings in the clip-retrieval layout matched to a dataset's images.

    Authors' files: our val split is drawn from their train rows, their observed labels kept. An spml-cache
    export: its own splits, labels and single positives, no images needed. Other clip-retrieval output: splits
    and single positives drawn from the dataset under --root, as extract draws them.

    Example: spml-cache import-features data/pascal --dataset voc
    Example: spml-cache import-features voc-embeddings --out cache/voc-imported.h5
    """
    from spml_cache.extract import import_features

    report = import_features(folder, dataset=dataset, root=root or default_data_root(), out=out,
                             classes_file=classes, force=force)
    counts = ", ".join(f"{split} {count}" for split, count in report.counts.items())
    console.print(f"wrote {escape(str(report.path))} ({counts})")
    for note in report.notes:
        console.print(f"[dim]{escape(note)}[/dim]")


def export_command(
    cache_file: Path = typer.Argument(..., help="The cache to export (an .h5 file)."),
    out: Path = typer.Option(..., "--out", help="A new (or empty) folder to write the clip-retrieval layout into."),
) -> None:
    """Write a cache's features in the clip-retrieval layout for other tools: img_emb/img_emb_{0,1,2}.npy (train,
    val, test) beside metadata/metadata_{i}.parquet (id, image_path, split, labels, observed), spml_cache.json.

    Example: spml-cache export cache/voc-resnet50-448.h5 --out voc-embeddings
    """
    from spml_cache.cache.embeddings import export

    report = export(cache_file, out)
    counts = ", ".join(f"{split} {count}" for split, count in report.counts.items())
    console.print(f"wrote {escape(str(report.folder))} ({counts} rows)")


def losses_command(
    names: Optional[List[str]] = typer.Argument(None, help="Only these losses, apart or comma-separated as --loss takes them: a built-in's name, an installed plugin's, path/to/file.py:Class or package.module:Class (default: every loss)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array (one object per loss) instead of a table."),
) -> None:
    """Every loss, or the losses named: name, description, paper reference, defaults (and per-dataset defaults), state, flags; with every loss, the installed plugins (entry-point group spml_cache.losses) too, with their origin.

    Override any default in training with --hp name=value. Your own loss: docs/your-own-loss.md.

    Example: spml-cache losses role
    Example: spml-cache losses --json
    Example: spml-cache losses examples/masked_focal.py:MaskedFocal
    """
    import json

    from spml_cache import losses
    from spml_cache.runtime.plugins import given_as_argument

    with given_as_argument():  # refusals name each NAME as typed: no --loss was given
        rows = losses.describe(tuple(name for given in names or () for name in given.split(",") if name))
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    console.print(losses.describe_table(rows))


def demo_command(
    out: Path = typer.Option(Path("demo"), "--out", help="Folder for the demo's data, cache, runs and plots."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    num_train: Optional[int] = typer.Option(None, "--train", hidden=True),
    num_test: Optional[int] = typer.Option(None, "--test", hidden=True),
    size: Optional[int] = typer.Option(None, "--size", hidden=True),
    resolution: Optional[int] = typer.Option(None, "--resolution", hidden=True),
    epochs: Optional[int] = typer.Option(None, "--epochs", hidden=True),
    lr: Optional[str] = typer.Option(None, "--lr", hidden=True),
    batch_size: Optional[str] = typer.Option(None, "--batch-size", hidden=True),
) -> None:
    """The whole pipeline on a generated VOC-style dataset, in one to two minutes on two CPU cores.

    Generates images, extracts ResNet-50 features, trains every loss, fine-tunes the best head for one epoch,
    prints the table and writes the figures.

    Example: spml-cache demo --out demo
    """
    from spml_cache.demo.run import DemoSizes, run_demo

    # The hidden size flags (for tests) override the demo's measured defaults only when given.
    sizes = {"num_train": num_train, "num_test": num_test, "size": size, "resolution": resolution, "epochs": epochs,
             "lrs": None if lr is None else parse_list(lr, "--lr", float),
             "batch_sizes": None if batch_size is None else parse_list(batch_size, "--batch-size", int)}
    run_demo(out, DemoSizes(**{k: v for k, v in sizes.items() if v is not None}), device=device, console=console)


def report_command(
    run_dirs: Optional[List[Path]] = typer.Argument(
        None, help="Run directories or folders of them (default: every run under --runs)."
    ),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Where to look for runs when none are named."),
    paper: bool = typer.Option(False, "--paper", help="Add the papers' published numbers and our difference."),
    fmt: Optional[str] = typer.Option(None, "--format", help="csv, md, json or tex (a LaTeX tabular with booktabs rules) instead of the terminal table."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the table to FILE (format from --format or the suffix: .csv, .md, .json, .tex)."),
    plots: Optional[Path] = typer.Option(None, "--plots", help="Also write the figures into DIR (needs matplotlib)."),
    figure_width: Optional[str] = typer.Option(None, "--figure-width", help="The figures' width as printed: column (3.3 in), text (6.9 in, the default) or inches, e.g. 5.5; each is laid out for it, every text at least 7 pt there."),
    figure_format: Optional[str] = typer.Option(None, "--figure-format", help="The figures' format: png (the default), pdf or svg (vector; pdf's fonts embedded as TrueType)."),
    dpi: Optional[int] = typer.Option(None, "--dpi", help="The figures' resolution in dots per inch, 50 to 600 (default: 300; pdf and svg are vector whatever it says)."),
    compare: Optional[str] = typer.Option(None, "--compare", help="Two losses a,b, e.g. an,role: their paired difference a - b per dataset and stage (bootstrap interval, p-value), and the per-class AP figure's pair (default there: the best two)."),
    pivot: Optional[str] = typer.Option(None, "--pivot", help="backbone: one dataset's linear runs as losses x backbones (with their feature kind); --plots then draws that table."),
    metric: Optional[str] = typer.Option(None, "--metric", help="The table's metric: map (the default), map11 (VOC07's 11-point interpolated mAP), lrap (label ranking average precision), cp, cr, cf1, op, or, of1 (labels scoring 0.5 or more), or one of those six with @K (cf1@3: of each image's K highest, those at 0.5 or more). csv, md and json carry every one."),
    ci: bool = typer.Option(False, "--ci", help="Add each cell's 95% bootstrap interval over the test images (the same resamples for every loss of a dataset)."),
    resamples: Optional[int] = typer.Option(None, "--resamples", help="Bootstrap resamples of the test images for --ci and --compare (default: 1,000)."),
) -> None:
    """Table-1 style table of test mAP (mean ± std over seeds) per loss, dataset and stage, and figures.

    When a loss was run several times for the same dataset and stage, the newest run is used and the older ones are named under the table; interrupted runs (no results.json) are listed, not tabulated.

    Example: spml-cache report --paper --plots figures --format md --out table1.md
    Example: spml-cache report --out table1.tex --plots figs --figure-format pdf --figure-width column
    Example: spml-cache report runs/voc --pivot backbone --plots figures
    Example: spml-cache report --metric cf1 --ci --compare an,role
    """
    from spml_cache import report

    report.report_command(report.ReportOptions(
        run_dirs or [], runs_root=runs, paper=paper, fmt=fmt, output=out, plots_dir=plots, compare=compare, pivot=pivot,
        ci=ci, figure_format=figure_format, dpi=dpi, figure_width=figure_width,
        **{key: value for key, value in (("metric", metric), ("resamples", resamples)) if value is not None},
    ), console)
