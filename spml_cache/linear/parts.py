"""A linear run's kept parts: each finished (loss, seed, batch size), its heads' histories and best states, kept in
the run's `jobs/` folder as it finishes, so that `--resume` trains only what is missing."""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

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


class KeptParts:
    """The `jobs/` folder of run `run_dir`: one checkpoint per kept (loss, seed, batch size)."""

    def __init__(self, run_dir: Path | str) -> None:
        self.folder = Path(run_dir) / "jobs"

    def path(self, key: str, seed: int, batch_size: int) -> Path:
        return self.folder / f"{runs.file_stem(key)}-seed{seed}-batch{batch_size}.pt"

    def keep(self, key: str, seed: int, batch_size: int, part: Part) -> None:
        """Keep the part of result `key` (the loss's name, or `loss@rule`: observation.result_key)."""
        self.folder.mkdir(exist_ok=True)
        runs.save_checkpoint(self.path(key, seed, batch_size), {
            "records": [{**record.to_state(), "best_state": record.best_state} for record in part.records],
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

    @staticmethod
    def _load(path: Path) -> Part:
        state = runs.load_checkpoint(path)
        records = []
        for entry in state["records"]:
            best_state = entry.pop("best_state")
            record = HeadRecord.from_state(entry)
            record.best_state = best_state
            records.append(record)
        if not records:
            raise ValueError("no heads in it")
        return Part(records, float(state["seconds"]))

    def remove(self) -> None:
        """Once the run's results are written, the parts are no longer needed."""
        shutil.rmtree(self.folder, ignore_errors=True)
