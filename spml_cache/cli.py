"""The `spml-cache` command: parses flags, calls one function per command, prints with rich.

Every command's work lives in its module; this file only turns flags into arguments and results into
tables. Errors a user can fix arrive as `SpmlError` and leave as one red line (exit 1); `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.text import Text

from spml_cache.errors import SpmlError

app = typer.Typer(
    name="spml-cache",
    help="Single-positive multi-label learning on a cached ResNet-50 feature matrix.\n\n"
    "Example: spml-cache demo",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
console = Console()
err_console = Console(stderr=True, soft_wrap=True)
_debug = {"on": bool(os.environ.get("SPML_DEBUG"))}


def default_data_root() -> Optional[Path]:
    """`SPML_DATA` is the default data root."""
    value = os.environ.get("SPML_DATA")
    return Path(value) if value else None


def default_cache_dir() -> Path:
    """`SPML_CACHE` is the default cache folder (else ./cache)."""
    return Path(os.environ.get("SPML_CACHE", "cache"))


def require_root(root: Optional[Path]) -> Path:
    if root is None:
        raise SpmlError("no data root: pass --root DIR or set SPML_DATA")
    return root


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback on errors."),
) -> None:
    if debug:
        _debug["on"] = True


# --- datasets, make-demo-data (datasets helper) ---


# --- extract, import-features (extract helper) ---


# --- losses (losses helper) ---


# --- linear, demo (linear helper) ---


# --- finetune (finetune helper) ---


# --- report (report helper) ---


def main() -> None:
    """Console-script entry point: run the app, turning user errors into one red line."""
    try:
        app()
    except SpmlError as err:
        if _debug["on"]:
            raise
        err_console.print(Text("error: ", style="bold red") + Text(str(err), style="red"))
        sys.exit(1)
    except Exception as err:  # a bug or an environment failure: still one line unless --debug
        if _debug["on"]:
            raise
        message = f"{type(err).__name__}: {err} (run with --debug for the traceback)"
        err_console.print(Text("error: ", style="bold red") + Text(message, style="red"))
        sys.exit(1)
