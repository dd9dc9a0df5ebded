"""Stage two's options: what a caller of `spml-cache linear` (the CLI or `run_linear`) gives, each declared once
with its default and its check, and where the run happens (`LinearPlacement`), which never changes its results.

An option left as None was not given: the protocol's default applies (`LinearOptions.value`) or, with `resume`,
the interrupted run's own setting, which a given option must not contradict (settings.refuse_contradictions).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Mapping, Sequence

from rich.console import Console

from spml_cache.observation import Rule
from spml_cache.protocol import GRID_BATCH_SIZES, GRID_LRS, LINEAR_EPOCHS
from spml_cache.runtime import memory
from spml_cache.runtime.errors import SpmlError


def _default(value) -> dict:
    """A field's metadata: the value a new run takes when the option is not given."""
    return {"default": value}


@dataclass(frozen=True)
class LinearOptions:
    """Every option of one `linear` run as given (None: not given)."""

    cache: Path | str | None = None  # the feature cache, or `dataset`'s one cache (find_cache)
    dataset: str | None = None
    losses: str | Sequence[str] | None = field(default=None, metadata=_default("all"))
    lrs: Sequence[float] | None = field(default=None, metadata=_default(GRID_LRS))
    batch_sizes: Sequence[int] | None = field(default=None, metadata=_default(GRID_BATCH_SIZES))
    epochs: int | None = field(default=None, metadata=_default(LINEAR_EPOCHS))
    seeds: int | None = field(default=None, metadata=_default(1))  # a count: seeds 0..N-1
    hparams: Mapping | None = field(default=None, metadata=_default({}))  # `--hp`, or a resumed run's Overrides
    val_labels: str | None = field(default=None, metadata=_default("clean"))
    wds: Sequence[float] | None = None  # the probe's weight decays (None: protocol.GRID_WDS)
    fidelity: str | None = None  # exact (None) or authors
    hp_grid: str | None = None  # paper: each loss's own search space
    observe: Sequence[Rule] | None = None  # the observation rules (None: single)
    from_run: Path | str | None = None  # every head starts from this linear run's
    resume: Path | str | None = None  # an interrupted run to go on with, under its own settings
    memory_budget: str | int | None = None  # bytes or "1GB" (None: most of the device's free memory)
    chunk_rows: int | None = None  # stream the train features in chunks of this many rows

    def __post_init__(self) -> None:
        rows = self.chunk_rows
        if rows is not None and (isinstance(rows, bool) or int(rows) != rows or rows < 1):
            raise SpmlError(f"--chunk-rows {rows}: give a whole number of rows, at least 1")
        object.__setattr__(self, "memory_budget", memory.parse_size(self.memory_budget))

    def value(self, name: str):
        """The option `name` as a new run takes it: as given, else its default."""
        given = getattr(self, name)
        return _DEFAULTS.get(name) if given is None else given

    def given(self) -> dict:
        """`{name: value or None}` of every option (what `--resume` compares with the run's own)."""
        return {option.name: getattr(self, option.name) for option in fields(self)}


_DEFAULTS = {option.name: option.metadata["default"] for option in fields(LinearOptions) if option.metadata}


@dataclass(frozen=True)
class LinearPlacement:
    """Where and how this process runs a `linear` run, none of which changes its results."""

    device: str = "auto"  # auto, cpu, cuda or cuda:N (under torchrun: each process's own GPU)
    out: Path | str | None = None  # the runs folder a new run is written under (None: runs); a resumed run's own
    workers: int = 0  # processes training jobs in parallel (0: one per core on the CPU when the grid is big)
    graphs: bool = True  # on a GPU, every stack at once as replayed CUDA graphs (False: eagerly, for debugging)
    cache_dir: Path | str | None = None  # where `dataset`'s cache is looked for
    console: Console | None = None  # where notes and progress go (None: the progress console)
