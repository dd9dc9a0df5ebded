"""The command line's text: the data root, how it shows what is not its own (Python's warnings, typer's help
columns), and what it prints (the extraction report, the fine-tuning summary). Flags' text is read by each option's
declaration (options/text.py)."""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from spml_cache.cli.stopping import under_torchrun
from spml_cache.options.keywords import default_data_root
from spml_cache.options.text import (  # noqa: F401 (the command line's readers, tested as cli.parse_*)
    either, parse_hparams, parse_list, parse_names,
)
from spml_cache.runtime.errors import SpmlError

CONSOLE = Console()  # what the commands print
ERR_CONSOLE = Console(stderr=True, soft_wrap=True)  # one red (or yellow) line per error or warning


def require_root(root: Optional[Path]) -> Path:
    """`--root`, else `SPML_DATA`, else a clear error."""
    root = root or default_data_root()
    if root is None:
        raise SpmlError("no data root: pass --root DIR or set SPML_DATA")
    return root


def one_line_warning(message, category, *_) -> None:
    """Python's warnings (e.g. `--weights none`) as one yellow line, without the source line they point at."""
    ERR_CONSOLE.print(Text(f"warning: {message}", style="yellow"))


def as_prose(doc: str | None) -> str:
    """A command's docstring as its --help shows it: each paragraph one line, which the terminal wraps at its own
    width (typer keeps a paragraph's source line breaks, which at 80 columns left short orphans mid-sentence);
    a paragraph of `Example:` lines keeps them, one a line."""
    paragraphs = []
    for paragraph in inspect.cleandoc(doc or "").split("\n\n"):
        lines = [line.strip() for line in paragraph.splitlines()]
        examples = lines and all(line.startswith("Example:") for line in lines)
        paragraphs.append("\n".join(lines) if examples else " ".join(lines))
    return "\n\n".join(paragraphs)


def help_as_prose(app) -> None:
    """Every registered command's help (its docstring, unless given) `as_prose`."""
    for command in app.registered_commands:
        if command.help is None:
            command.help = as_prose(command.callback.__doc__)


def no_type_for_flags() -> None:
    """Recent typer shows a type column for every option, `<bool>` for a flag, which reads as if the flag took a
    value: show none for flags (a no-op where typer has no such column)."""
    try:
        from typer.core import TyperOption
    except ImportError:
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is not None:
        TyperOption.display_type_rich = lambda self, ctx: None if self.is_flag else shown(self, ctx)


def finetune_summary(results: dict) -> list[str]:
    """What `spml-cache finetune` prints per loss (rich markup; names and paths escaped): the selected config,
    its val and test mAP, and a result that ended below its start (epoch 0)."""
    lines, run_dir = [], escape(str(results.get("run_dir")))
    for name, summary in results.get("losses", {}).items():
        selected = summary["selected"]
        if selected is None:
            lines.append(f"[bold]{escape(name)}[/bold]: {escape(summary['error'])} -> {run_dir}")
            continue
        below = (f", below its start (epoch 0: test mAP {summary['start']['test_map']:.2f})"
                 if summary.get("below_start") else "")
        lines.append(
            f"[bold]{escape(name)}[/bold] lr {selected['lr']:g}, batch {selected['batch_size']}: val mAP"
            f" {summary['val_map']:.2f} ± {summary['val_map_std']:.2f}, test mAP {summary['test_map']:.2f} ±"
            f" {summary['test_map_std']:.2f} (best epoch {summary['best_epoch']}){below} -> {run_dir}"
        )
    return lines


def extract_report(report, console: Console) -> None:
    """What `spml-cache extract` prints about the cache it made (or would make)."""
    from rich.table import Table

    console.print(f"[bold]{report.status}[/bold]: {escape(str(report.path))}")
    table = Table(show_header=True)
    for column in ("split", "images"):
        table.add_column(column)
    for split, count in report.counts.items():
        table.add_row(split, str(count))
    console.print(table)
    size = f"{report.size_bytes / 2**20:.1f} MiB" + (" (estimated)" if report.status == "dry run" else "")
    decoder = f", decoder {report.decoder}" if report.decoder else ""
    console.print(f"size {size}; device {escape(str(report.device))}{decoder}")
    if report.status == "written":
        # in fp16/bf16, always how many rows the finite check sent back to fp32 (0 is the expected count)
        reduced = report.precision in ("fp16", "bf16")
        console.print(
            f"extracted {report.extracted - report.left_out} images in {report.seconds:.1f} s"
            f" ({report.images_per_s:.1f} img/s)" + (f", {report.left_out} left out" if report.left_out else "")
            + (f", {sum(report.recomputed.values())} recomputed in fp32 (non-finite in {report.precision})"
               if reduced else "")
            + (f"; {report.resumed} were already done (resumed)" if report.resumed else "")
        )
    if report.missing:
        shown = escape(", ".join(report.missing[:5])) + (" ..." if len(report.missing) > 5 else "")
        console.print(f"[yellow]{len(report.missing)} image files missing: {shown}[/yellow]")
    for split, ids in report.skipped.items():
        if ids:
            console.print(f"[yellow]{split}: {len(ids)} undecodable images left out: {escape(', '.join(ids[:5]))}[/yellow]")
    for note in report.notes:
        console.print(f"[dim]{escape(note)}[/dim]")


def last_line(line: Text, code: int) -> None:
    """The command's last word, and its exit. Under torchrun the line is also the process's error file, which the
    launcher's failure report shows as this process's message instead of a link to its docs (README, torchrun)."""
    ERR_CONSOLE.print(line)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") if under_torchrun() else None
    if error_file:
        try:  # torchrun's format: {"message": text, "timestamp": seconds}
            Path(error_file).write_text(json.dumps({"message": line.plain, "timestamp": int(time.time())}))
        except OSError:  # the report then links to torchrun's docs, as without it
            pass
    sys.exit(code)

