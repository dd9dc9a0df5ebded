"""What an experiment has made: the run directory (or imported cache) of each step, in one JSON file beside its runs
(`<runs>/experiments/<name>.json`), written atomically as soon as a step's run directory exists (`runs/files.py`),
so that an experiment stopped anywhere goes on with its own runs and reuses its finished ones.

A step is known by what it computes: its command's options that change results, with the caches and runs it reads
(`Step.command(results_only=True)`); where it runs (the device, the workers, the trackers) is not part of it, and a
step whose settings changed in the file is a new step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from spml_cache.runs import read_json, write_json
from spml_cache.runtime.errors import SpmlError


@dataclass
class State:
    path: Path
    file: Path  # the experiment file it belongs to, resolved
    made: dict[str, str] = field(default_factory=dict)  # {step's key: its run directory or cache}

    @classmethod
    def read(cls, path: Path, file: Path) -> "State":
        """The state at `path` (none yet: empty); one of another experiment file is refused, naming the fix."""
        file = Path(file).resolve()
        if not path.exists():
            return cls(path, file)
        found = read_json(path, dict, fix=": an experiment's state, cut short or damaged: remove it (the"
                          " experiment's finished runs are then run again)")
        if found.get("file") != str(file):
            raise SpmlError(f"{path} is the state of the experiment {found.get('file')}, not of {file}: give this"
                            " one another name ([experiment] name = ...) or another runs folder ([experiment] runs)")
        made = found.get("made")
        if not isinstance(made, dict) or not all(isinstance(one, str) for one in made.values()):
            raise SpmlError(f"{path}: its made is not what spml-cache writes there (edited or damaged): remove it")
        return cls(path, file, dict(made))

    def found(self, key: str) -> Path | None:
        """What the step known by `key` made, as recorded (it may since have gone)."""
        made = self.made.get(key)
        return None if made is None else Path(made)

    def keep(self, key: str, made: Path) -> None:
        """Record what a step made, at once (atomically: a stop leaves the old state or the new)."""
        self.made[key] = str(made)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"file": str(self.file), "made": self.made})
