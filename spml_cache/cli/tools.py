"""The `spml-cache` commands around the three stages: the datasets found, demo data, features made elsewhere in
and out, the losses, the demo and the report. Each is a thin function, registered on the app in `cli/__init__.py`
in the order `--help` lists them."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from spml_cache.cli.text import CONSOLE as console, default_data_root
from spml_cache.options.demo import DemoData, DemoPlacement, DemoSizes
from spml_cache.options.extract import ImportOptions
from spml_cache.options.report import ReportOptions


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


def make_demo_data_command(given: DemoData) -> None:
    """Write a small synthetic dataset in the real PASCAL VOC 2012 layout: coloured shapes, 20 VOC classes.

    1-3 objects per image, each class its own (colour, shape) look, ~10% of objects "difficult" (flag 0).

    Example: spml-cache make-demo-data demo-data --train 400 --test 200
    """
    from spml_cache.demo.data import write_demo_data

    root = write_demo_data(given)
    console.print(f"wrote {given.num_train} train + {given.num_test} test images ({given.size} px, VOC 2012 layout)"
                  f" under {escape(str(root))}")
    next_command = shlex.join(["spml-cache", "extract", "voc", "--root", str(root), "--weights", "none",
                               "--resolution", str(given.size)])
    console.print(f"[dim]next: {escape(next_command)}[/dim]")


def import_features_command(options: ImportOptions) -> None:
    """Turn features computed elsewhere into a project cache: the authors' published features (their `val` = the
    official test split), or embeddings in the clip-retrieval layout matched to a dataset's images.

    Authors' files: our val split is drawn from their train rows, their observed labels kept. An spml-cache
    export: its own splits, labels and single positives, no images needed. Other clip-retrieval output: splits
    and single positives drawn from the dataset under --root, as extract draws them.

    Example: spml-cache import-features data/pascal --dataset voc
    Example: spml-cache import-features voc-embeddings --out cache/voc-imported.h5
    """
    from spml_cache.extract import run_import

    report = run_import(options)
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


def demo_command(sizes: DemoSizes, placement: DemoPlacement) -> None:
    """The whole pipeline on a generated VOC-style dataset, in one to two minutes on two CPU cores.

    Generates images, extracts ResNet-50 features, trains every loss, fine-tunes the best head for one epoch,
    prints the table and writes the figures.

    Example: spml-cache demo --out demo
    """
    from spml_cache.demo.run import run_demo

    run_demo(placement.out, sizes, device=placement.device, console=console)


def report_command(options: ReportOptions) -> None:
    """Table-1 style table of test mAP (mean ± std over seeds) per loss, dataset and stage, and figures.

    When a loss was run several times for the same dataset and stage, the newest run is used and the older ones are named under the table; interrupted runs (no results.json) are listed, not tabulated.

    Example: spml-cache report --paper --plots figures --format md --out table1.md
    Example: spml-cache report --out table1.tex --plots figs --figure-format pdf
    Example: spml-cache report --plots figs --figure-width column
    Example: spml-cache report runs/voc --pivot backbone --plots figures
    Example: spml-cache report --metric cf1 --ci --compare an,role
    """
    from spml_cache import report

    report.report_command(options, console)
