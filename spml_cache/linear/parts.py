"""A linear run's kept parts: each finished (loss, seed, batch size), its heads' histories and best states, kept in
the run's `jobs/` folder as it finishes, so that `--resume` trains only what is missing.

A head's best state goes to a file of its own (`jobs/states/`) as soon as its part, or its lr group, is done, and
the record holds a `StoredState` from then on: selection reads back (memory-mapped) only the states it keeps, so a
grid's finished heads never wait in memory (a cache of 5,000 classes makes each one 41 MB).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from spml_cache import runs
from spml_cache.observation import result_key
from spml_cache.selection import HeadRecord


@dataclass
class Part:
    """The heads of one (loss, seed, batch size) or of a job (their records), and the seconds they took."""

    records: list[HeadRecord]
    seconds: float

    def merged(self, other: "Part") -> "Part":
        """This part and another one of the same (loss, seed, batch size): its other lrs' heads."""
        return Part(self.records + other.records, self.seconds + other.seconds)

    def of_batch_size(self, batch_size: int) -> "Part":
        """The heads of one batch size, credited their share of the seconds."""
        own = [record for record in self.records if record.batch_size == batch_size]
        return Part(own, self.seconds * len(own) / len(self.records))


class StoredState(Mapping):
    """A head's best state (`{"head": ..., "loss_state": ...}`) in its file, read memory-mapped at each access:
    only the pages of the tensors used are read, and nothing stays in memory after."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _state(self) -> dict:
        return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)

    def __getitem__(self, key: str):
        return self._state()[key]

    def __iter__(self):
        return iter(self._state())

    def __len__(self) -> int:
        return len(self._state())


class KeptParts:
    """The `jobs/` folder of run `run_dir`: one checkpoint per kept (loss, seed, batch size), naming the files of
    its heads' best states under `states/`."""

    def __init__(self, run_dir: Path | str) -> None:
        self.folder = Path(run_dir) / "jobs"
        self.states = self.folder / "states"

    def path(self, key: str, seed: int, batch_size: int) -> Path:
        return self.folder / f"{runs.file_stem(key)}-seed{seed}-batch{batch_size}.pt"

    def state_path(self, key: str, record: HeadRecord) -> Path:
        """The file of one head's best state: its part's name, its lr (and weight decay) and (a sweep) its hyperparameters' digest."""
        swept = hashlib.sha1(json.dumps(record.hparams, sort_keys=True).encode()).hexdigest()[:10]
        wd = "" if record.wd is None else f"-wd{record.wd:g}"
        return self.states / f"{self.path(key, record.seed, record.batch_size).stem}-lr{record.lr:g}{wd}-{swept}.pt"

    def spill(self, key: str, part: Part) -> Part:
        """Write each best state still in memory to its file and leave the record a `StoredState` in its place."""
        for record in part.records:
            if record.best_state is not None and not isinstance(record.best_state, StoredState):
                self.states.mkdir(parents=True, exist_ok=True)
                record.best_state = StoredState(runs.save_checkpoint(self.state_path(key, record), record.best_state))
        return part

    def keep(self, key: str, seed: int, batch_size: int, part: Part) -> None:
        """Keep the part of result `key` (the loss's name, or `loss@rule`: observation.result_key); its records'
        best states are spilled to their files (written before the part file that names them)."""
        self.folder.mkdir(exist_ok=True)
        self.spill(key, part)
        runs.save_checkpoint(self.path(key, seed, batch_size), {
            "records": [{**record.to_state(),
                         "best_state": None if record.best_state is None else record.best_state.path.name} for record in part.records],
            "seconds": part.seconds,
        })

    def read(self) -> dict[tuple[str, int, int], Part]:
        """Every kept part: `{(result key, seed, batch size): Part}`. A part that cannot be read (a file damaged
        outside the atomic writes: a full disk, a copy cut short) is removed with a warning, and so trained again."""
        kept = {}
        for path in sorted(self.folder.glob("*.pt")):
            try:
                part = self._load(path)
            except Exception as err:  # torch raises several types for a damaged archive
                warnings.warn(f"{path} is damaged ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                              "; that part is trained again")
                path.unlink(missing_ok=True)
                continue
            first = part.records[0]
            kept[(result_key(first.loss, first.rule), first.seed, first.batch_size)] = part
        return kept

    def losses(self) -> set[str]:
        """The losses with a kept part."""
        return {part.records[0].loss for part in self.read().values()}

    def _load(self, path: Path) -> Part:
        state = runs.load_checkpoint(path)
        records = []
        for entry in state["records"]:
            best_state = entry.pop("best_state")  # its file's name (a part kept before 2026-11-25: the state)
            if isinstance(best_state, str):
                if not (self.states / best_state).is_file():
                    raise ValueError(f"its head's best state {self.states / best_state} is missing")
                best_state = StoredState(self.states / best_state)
            record = HeadRecord.from_state(entry)
            record.best_state = best_state
            records.append(record)
        if not records:
            raise ValueError("no heads in it")
        return Part(records, float(state["seconds"]))

    def remove(self) -> None:
        """Once the run's results are written, the parts are no longer needed."""
        shutil.rmtree(self.folder, ignore_errors=True)
