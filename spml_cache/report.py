"""Table-1 style tables and figures from run directories (docs/internals.md, "run directories").

Reads only the files the stages write: `config.json`, `results.json` (its absence marks an interrupted run),
`metrics.jsonl`, `scores/<loss>.npz`, `labels.npz`. One row per loss, one column per dataset x stage x cache;
a cell is the test mAP at the selected epoch, mean +- std over the run's seeds. When a loss was run several
times for the same column, the newest run (by the stamp in its directory name) is used and the older ones are
named in the notes, so re-running one loss replaces just that row.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from spml_cache.errors import SpmlError
from spml_cache.runs import RESULTS, is_complete, read_json, run_stamp
from spml_cache.runs import replace_atomically

RUN_FILES = ("config.json", RESULTS, "metrics.jsonl")
# Fine-tuning from a fresh ImageNet model is another experiment than from the best linear head (LinearInit).
STAGE_LABELS = {"linear": "linear", "finetune": "fine-tuned", "finetune-imagenet": "fine-tuned from ImageNet"}
DATASET_LABELS = {"voc": "VOC", "coco": "COCO", "nus": "NUS", "cub": "CUB"}

# The papers' numbers (spec/protocol.md), in DATASET_LABELS order: (stage, loss) -> (seed table, values).
PAPER_SEEDS = {
    "002": "Cole et al., CVPR 2021 (seeds/002_c72ef981da2e5818.txt)",
    "003": "Zhou et al., ECCV 2022 (seeds/003_3374644069f55c2a.txt)",
    "001": "Chen et al., IJCAI 2024 (seeds/001_39111bea80619397.txt)",
    "004": "Li, Wang, Chen, OPML (seeds/004_51bf331b0fdf0b33.txt)",
}
PAPER = {
    ("linear", "bce"): ("002 Table 1", (86.7, 70.0, 50.7, 29.1)),
    ("linear", "bce_ls"): ("002 Table 1", (87.6, 70.2, 51.7, 29.3)),
    ("linear", "iun"): ("002 Table 1", (86.4, 67.0, 49.0, 19.4)),
    ("linear", "an"): ("002 Table 1", (84.2, 62.3, 46.2, 17.2)),
    ("linear", "an_ls"): ("002 Table 1", (85.3, 64.8, 48.5, 15.4)),
    ("linear", "wan"): ("002 Table 1", (84.1, 63.1, 45.8, 17.9)),
    ("linear", "epr"): ("002 Table 1", (83.8, 62.6, 46.4, 18.0)),
    ("linear", "role"): ("002 Table 1", (86.5, 66.3, 49.5, 16.2)),
    ("finetune", "role"): ("002 Table 1, +LinearInit", (88.2, 69.0, 51.0, 16.8)),
    ("finetune", "an_ls"): ("002 Table 1, +LinearInit", (86.5, 69.2, 50.5, 16.6)),
    ("finetune", "em"): ("003 Table 1", (89.09, 70.70, 47.15, 20.85)),
    ("finetune", "em_apl"): ("003 Table 1", (89.19, 70.87, 47.59, 21.84)),
    ("finetune", "gr"): ("001 Table 2", (89.83, 73.17, 49.08, 21.64)),
    ("finetune", "opml"): ("004 Table II", (87.77, 68.93, 47.93, 22.30)),
    ("finetune", "opml_sp"): ("004 Table II", (89.20, 71.75, 50.14, 24.11)),
}


def paper_number(stage: str, dataset: str, loss: str) -> tuple[float, str] | None:
    """The published test mAP for this loss, dataset and stage, with the seed table it comes from."""
    entry = PAPER.get((stage.split("-")[0], loss))
    if entry is None or dataset not in DATASET_LABELS:
        return None
    source, values = entry
    return values[list(DATASET_LABELS).index(dataset)], source


@dataclass
class Run:
    """One run directory; `results` is None for an incomplete (interrupted or unreadable) run."""

    path: Path
    stage: str
    dataset: str
    cache_id: str
    stamp: tuple[str, int]  # (YYYYmmdd-HHMMSS, same-second counter): orders runs, newest last
    config: dict
    results: dict | None
    problem: str = ""

    @property
    def losses(self) -> dict:
        return self.results["losses"] if self.results else {}


def read_run(path: Path) -> Run:
    """Read one run directory without trusting that the run finished."""
    config = results = None
    problem = f"no {RESULTS}: interrupted or still running"
    try:
        config = read_json(path / "config.json") if (path / "config.json").exists() else None
        results = read_json(path / RESULTS) if is_complete(path) else None
    except SpmlError as err:  # half-written by hand or by a crash: report it, do not stop the table
        problem = str(err)
    if results is not None and not (results.get("complete") and isinstance(results.get("losses"), dict)):
        results, problem = None, f"{RESULTS} not marked complete"
    known = {**(config or {}), **(results or {})}
    init = known.get("init") if isinstance(known.get("init"), dict) else {}
    return Run(
        path=path,
        stage=(known.get("stage") or path.name.split("-")[0]) + ("-imagenet" if init.get("mode") == "imagenet" else ""),
        dataset=known.get("dataset") or path.parent.name,
        cache_id=str(known.get("cache_id") or "unknown"),
        stamp=run_stamp(path),
        config=config or {},
        results=results,
        problem=problem if results is None else "",
    )


def collect_runs(paths: list[Path] | None = None, *, runs_root: Path = Path("runs")) -> list[Run]:
    """Every run directory named in `paths` or found below them (default: below `runs_root`)."""
    looked = [Path(p) for p in paths] if paths else [Path(runs_root)]
    found: dict[Path, Path] = {}  # resolved -> as the user named it, so notes show familiar paths
    for path in looked:
        if not path.exists():
            raise SpmlError(f"no runs found: {path} does not exist; pass run directories or --runs DIR")
        if any((path / name).exists() for name in RUN_FILES):
            found.setdefault(path.resolve(), path)
            continue
        for name in RUN_FILES:
            for file in path.rglob(name):
                found.setdefault(file.parent.resolve(), file.parent)
    if not found:
        where = ", ".join(str(p) for p in looked)
        raise SpmlError(
            f"no run directories found under {where} (looked for {', '.join(RUN_FILES)}); "
            "train some with `spml-cache linear` or pass --runs DIR"
        )
    return [read_run(found[key]) for key in sorted(found)]


@dataclass
class Cell:
    mean: float
    std: float | None  # None with one seed
    seeds: int
    run: Path
    best: bool = False
    paper: float | None = None
    source: str | None = None

    @property
    def diff(self) -> float | None:
        return None if self.paper is None else self.mean - self.paper


@dataclass
class Column:
    dataset: str
    stage: str
    cache_id: str
    label: str
    weights: str | None = None  # the backbone weights that made the cache's features


@dataclass
class Table:
    columns: list[Column]
    rows: list[tuple[str, dict[str, Cell]]]  # (loss, {column label: cell})
    oracles: set[str]
    paper: bool
    notes: list[str] = field(default_factory=list)
    incomplete: list[Run] = field(default_factory=list)


def in_spec_order(names) -> list[str]:
    """`names` in the registry's order (spec/losses.md), names it does not know last."""
    from spml_cache import losses

    order = losses.names()
    return [name for name in order if name in names] + sorted(set(names) - set(order))


def oracle_losses() -> set[str]:
    """The losses that read the full labels: upper bounds, not single-positive methods."""
    from spml_cache import losses

    return {name for name in losses.names() if losses.get(name).oracle}


def _column_label(dataset: str, stage: str, cache_id: str, several_caches: bool) -> str:
    label = f"{DATASET_LABELS.get(dataset, dataset)} {STAGE_LABELS.get(stage, stage)}"
    return f"{label} (cache {cache_id[:8]})" if several_caches else label


def select_newest(runs: list[Run]) -> tuple[list[Column], dict[tuple[str, str], Run], list[str]]:
    """Columns, the newest complete run per (column label, loss), and notes on what was set aside."""
    complete = [run for run in runs if run.results is not None]
    caches: dict[str, set[str]] = {}
    for run in complete:
        caches.setdefault(run.dataset, set()).add(run.cache_id)
    notes = [
        f"{ds}: runs from {len(ids)} different caches ({', '.join(sorted(i[:8] for i in ids))}): reported apart"
        for ds, ids in sorted(caches.items())
        if len(ids) > 1
    ]
    columns: dict[str, Column] = {}
    history: dict[tuple[str, str], list[Run]] = {}
    for run in sorted(complete, key=lambda r: (r.stamp, r.path.name)):
        label = _column_label(run.dataset, run.stage, run.cache_id, len(caches[run.dataset]) > 1)
        weights = run.config.get("cache_attrs", {}).get("weights")
        columns.setdefault(label, Column(run.dataset, run.stage, run.cache_id, label, weights))
        for loss, result in run.losses.items():
            if "test_map" in result:
                history.setdefault((label, loss), []).append(run)
            else:  # the stage records a loss whose every head diverged, with no numbers
                notes.append(f"{loss} ({label}): no result in {run.path} ({result.get('error', 'no test_map')})")
    chosen = {key: runs_of_key[-1] for key, runs_of_key in history.items()}
    for (label, loss), runs_of_key in sorted(history.items()):
        if len(runs_of_key) > 1:
            older = ", ".join(str(r.path) for r in runs_of_key[:-1])
            notes.append(f"{loss} ({label}): newest of {len(runs_of_key)} runs used, {runs_of_key[-1].path}; older: {older}")
    stage_order = list(STAGE_LABELS)
    ordered = sorted(
        columns.values(),
        key=lambda c: (
            stage_order.index(c.stage) if c.stage in stage_order else len(stage_order),
            list(DATASET_LABELS).index(c.dataset) if c.dataset in DATASET_LABELS else len(DATASET_LABELS),
            c.label,
        ),
    )
    return ordered, chosen, notes


def _cell(run: Run, loss: str) -> Cell:
    result = run.losses[loss]
    seeds = len(result.get("per_seed") or []) or 1
    std = result.get("test_map_std") if seeds > 1 else None
    return Cell(mean=float(result["test_map"]), std=None if std is None else float(std), seeds=seeds, run=run.path)


def build_table(runs: list[Run], *, paper: bool = False) -> Table:
    """The Table-1 layout: best single-positive loss per column marked (oracles excluded, as in the papers)."""
    columns, chosen, notes = select_newest(runs)
    oracles = oracle_losses()
    present = {loss for _, loss in chosen}
    rows = []
    for loss in in_spec_order(present):
        cells = {}
        for column in columns:
            run = chosen.get((column.label, loss))
            if run is None:
                continue
            cells[column.label] = cell = _cell(run, loss)
            if paper and (published := paper_number(column.stage, column.dataset, loss)):
                cell.paper, cell.source = published
        rows.append((loss, cells))
    for column in columns:
        candidates = [cells[column.label] for loss, cells in rows if loss not in oracles and column.label in cells]
        if candidates:
            max(candidates, key=lambda c: c.mean).best = True
        if paper and column.dataset in DATASET_LABELS and column.weights not in (None, "IMAGENET1K_V1"):
            notes.append(f"{column.label}: ResNet-50 weights '{column.weights}', the papers' IMAGENET1K_V1:"
                         " the comparison is not like for like")
    return Table(columns, rows, oracles & present, paper, notes, [run for run in runs if run.results is None])


def cell_text(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    return f"{cell.mean:.2f}" + (f" ± {cell.std:.2f}" if cell.std is not None else "")


def _grid(table: Table, mark_best) -> tuple[list[str], list[list[str]]]:
    """Header and text rows shared by the terminal and Markdown tables; `mark_best` decorates best cells."""
    header = ["loss"]
    for column in table.columns:
        header += [column.label] + (["paper", "Δ"] if table.paper else [])
    rows = []
    for loss, cells in table.rows:
        row = [f"{loss} (oracle)" if loss in table.oracles else loss]
        for column in table.columns:
            cell = cells.get(column.label)
            row.append(mark_best(cell_text(cell)) if cell is not None and cell.best else cell_text(cell))
            if table.paper:
                # the published number as the paper prints it, then ours minus it
                has_paper = cell is not None and cell.paper is not None
                row += [str(cell.paper), f"{cell.diff:+.2f}"] if has_paper else ["", ""]
        rows.append(row)
    return header, rows


def footnotes(table: Table) -> list[str]:
    notes = ["best single-positive loss per column in bold (*); oracles (full labels) excluded"] if table.rows else []
    notes += table.notes
    used = sorted({cell.source for _, cells in table.rows for cell in cells.values() if cell.source})
    if used:
        notes.append(f"paper numbers: {'; '.join(used)}")
        notes += [f"{seed}: {PAPER_SEEDS[seed]}" for seed in sorted({source[:3] for source in used})]
    notes += [f"incomplete, not tabulated: {run.path} ({run.problem})" for run in table.incomplete]
    return notes


def to_csv(table: Table) -> str:
    """Wide CSV for spreadsheets: per column `mean`, `std`, `seeds`, `best` (and `paper`, `diff`, `source`)."""
    fields = ["mean", "std", "seeds", "best"] + (["paper", "diff", "source"] if table.paper else [])
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["loss"] + [f"{column.label} {name}" for column in table.columns for name in fields])
    for loss, cells in table.rows:
        row = [loss]
        for column in table.columns:
            cell = cells.get(column.label)
            values = {} if cell is None else {**vars(cell), "best": int(cell.best), "diff": cell.diff}
            row += ["" if values.get(name) is None else values[name] for name in fields]
        writer.writerow(row)
    return buffer.getvalue()


def to_markdown(table: Table) -> str:
    header, rows = _grid(table, lambda text: f"**{text}**")
    lines = ["| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *rows]]
    lines += [""] + [f"- {note}" for note in footnotes(table)] if footnotes(table) else []
    return "\n".join(lines) + "\n"


def to_json(table: Table) -> str:
    payload = {
        "metric": "test mAP (0-100) at the selected epoch; mean and std over the run's seeds",
        "columns": [vars(column) for column in table.columns],
        "rows": [{"loss": loss, "oracle": loss in table.oracles,
                  "cells": {label: {**vars(cell), "run": str(cell.run), "diff": cell.diff} for label, cell in cells.items()}}
                 for loss, cells in table.rows],
        "notes": table.notes,
        "incomplete": [{"path": str(run.path), "problem": run.problem} for run in table.incomplete],
        "paper_sources": PAPER_SEEDS if table.paper else {},
    }
    return json.dumps(payload, indent=2) + "\n"


def formatter(fmt: str):
    """The function that renders a table as `fmt` (csv, md, json)."""
    formatters = {"csv": to_csv, "md": to_markdown, "json": to_json}
    if fmt not in formatters:
        raise SpmlError(f"--format {fmt}: unknown format; use one of {', '.join(formatters)}")
    return formatters[fmt]


def print_table(table: Table, console: Console) -> None:
    header, rows = _grid(table, lambda text: f"[bold green]{text} *[/]")
    title = "Test mAP at the selected epoch (mean ± std over seeds)"
    rich_table = RichTable(title=title, title_justify="left", min_width=len(title))
    for i, name in enumerate(header):
        rich_table.add_column(name, justify="left" if i == 0 else "right", style="dim" if name == "paper" else None)
    losses = [loss for loss, _ in table.rows] + [None]
    for i, row in enumerate(rows):
        # the papers' break between the oracles and the single-positive losses
        rich_table.add_row(*row, end_section=losses[i] in table.oracles and losses[i + 1] not in table.oracles)
    console.print(rich_table if rows else "no complete runs to tabulate")
    print_notes(table, console)


def print_notes(table: Table, console: Console) -> None:
    for note in footnotes(table):
        console.print(Text(note, style="dim"))  # Text: paths and names are not rich markup


def print_report(run_dirs: list[Path], *, paper: bool = False, console: Console | None = None) -> None:
    """The table of every run in `run_dirs` (run directories or folders of them; [] means ./runs)."""
    print_table(build_table(collect_runs(run_dirs), paper=paper), console or Console())


def write_plots(run_dirs: list[Path], out_dir: Path, *, compare=None, console: Console | None = None) -> list[Path]:
    """PNG figures of the runs in `run_dirs` into `out_dir` (drawn by spml_cache/plots.py); the paths written."""
    from spml_cache import plots  # matplotlib is only needed here

    return plots.write_plots(run_dirs, out_dir, compare=compare, console=console)


def report_command(
    paths: list[Path], *, runs_root: Path, paper: bool, fmt: str | None, output: Path | None,
    plots_dir: Path | None, compare: str | None, console: Console,
) -> None:
    """`spml-cache report`: check every flag first, then the table (terminal or file), then the figures."""
    if output is not None and fmt is None:
        fmt = {".csv": "csv", ".md": "md", ".json": "json"}.get(output.suffix.lower())
        if fmt is None:
            raise SpmlError(f"--output {output}: cannot tell the format from the suffix; add --format csv|md|json")
    render = formatter(fmt) if fmt is not None else None
    if compare is not None and plots_dir is None:
        raise SpmlError("--compare chooses the losses of the per-class figure: add --plots DIR")
    if plots_dir is not None:
        from spml_cache.plots import parse_compare, plot_runs, require_matplotlib

        require_matplotlib()
        pair = parse_compare(compare)
    runs = collect_runs(paths, runs_root=runs_root)
    table = build_table(runs, paper=paper)
    if render is None:
        print_table(table, console)
    elif output is None:
        console.out(render(table), highlight=False, end="")
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(output, lambda partial: partial.write_text(render(table), encoding="utf-8"))
        console.print(f"wrote {output} ({len(table.rows)} losses x {len(table.columns)} columns)")
        print_notes(table, console)
    if plots_dir is not None:
        for path in plot_runs(runs, plots_dir, compare=pair, console=console):
            console.print(f"wrote {path}")
