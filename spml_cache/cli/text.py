"""The command line's text: what it turns flags into (comma lists, `--hp` items, the data root), how it shows what
is not its own (Python's warnings, typer's help columns), and the extraction report it prints."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from spml_cache import datasets, observation  # registries the help texts list (no torch)
from spml_cache.cli.stopping import under_torchrun
from spml_cache.runtime.errors import SpmlError

CONSOLE = Console()  # what the commands print
ERR_CONSOLE = Console(stderr=True, soft_wrap=True)  # one red (or yellow) line per error or warning


def default_data_root() -> Optional[Path]:
    """`SPML_DATA` is the default data root."""
    value = os.environ.get("SPML_DATA")
    return Path(value) if value else None


def require_root(root: Optional[Path]) -> Path:
    """`--root`, else `SPML_DATA`, else a clear error."""
    root = root or default_data_root()
    if root is None:
        raise SpmlError("no data root: pass --root DIR or set SPML_DATA")
    return root


def parse_list(text: str, flag: str, kind: type) -> list:
    """A comma list of numbers (`--lr 1e-3,1e-4`): a clear error naming the flag otherwise. The stages check
    the values themselves."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    try:
        return [kind(item) for item in items]
    except ValueError:
        what = "numbers" if kind is float else "whole numbers"
        raise SpmlError(f"{flag} {text!r}: expected a comma list of {what}") from None


def parse_names(text: str) -> list[str]:
    """A comma list of names (`--loss an,role`)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def parse_hparams(items: List[str]) -> dict:
    """`--hp key=value` or `--hp loss.key=value` (repeatable) as `{key: value}`; `key=v1,v2,...` as a list of
    values to sweep (several swept keys give their product). The losses check the values (`losses.Overrides`)."""
    given = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise SpmlError(f"--hp {item!r}: expected key=value or loss.key=value, e.g. --hp alpha=0.1")
        if not text.strip(","  " ").strip():
            raise SpmlError(f"--hp {item!r}: no value; give one, or a comma list to sweep, e.g. --hp {key.strip()}=0.1,0.2")
        values = []
        for part in text.split(","):
            try:
                values.append(int(part) if part.strip().lstrip("-").isdigit() else float(part))
            except ValueError:
                raise SpmlError(f"--hp {item!r}: {part.strip()!r} is not a number (a comma list sweeps values)") from None
        given[key.strip()] = values if "," in text else values[0]
    return given


def one_line_warning(message, category, *_) -> None:
    """Python's warnings (e.g. `--weights none`) as one yellow line, without the source line they point at."""
    ERR_CONSOLE.print(Text(f"warning: {message}", style="yellow"))


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


# Help texts list what the registries hold, so that a new dataset or rule appears in --help by itself.
def _either(names: list[str]) -> str:
    """`a, b or c`: a registry's names as a help text lists them."""
    return ", ".join(names[:-1]) + f" or {names[-1]}"


DATASETS_HELP = _either(datasets.names())
PUBLISHED_HELP = _either(list(datasets.values_of("PUBLISHED_ID_PREFIX")))  # the datasets import-features knows
RULES_HELP = ", ".join(rule.example for rule in observation.RULES.values())
