"""Losses from outside the package (docs/your-own-loss.md): `path/to/file.py:Class`, `package.module:Class`, or a
name an installed distribution declares in the entry-point group `spml_cache.losses`; runtime/plugins.py loads
all three, for backbones too.

A plugin is a subclass of `spml_cache.losses.Loss` with its own `name`, which is what results, run directories and
the report call it. Its origin (the file and its content hash, or the distribution and its version) goes into
config.json (`records`), so that `--resume` loads the very same code again or refuses (`load_recorded`).
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from pathlib import Path

from spml_cache.losses.base import LOSSES, Loss
from spml_cache.runtime import plugins as loader
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.plugins import LOSSES as KIND
from spml_cache.runtime.plugins import Origin

GROUP = KIND.group
GUIDE = KIND.guide
NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # a result key, a file stem and an --hp prefix as it is
# A name is part of file names (a run directory's, `scores/NAME@RULE.npz`, a kept part's state files with its lr and
# swept values), which filesystems cap at 255 bytes: 64 characters leave room for the rest of each.
NAME_MAX = 64

_LOADED: dict[str, tuple[type[Loss], dict]] = {}  # loss name -> (class, origin record)


def is_spec(text: str) -> bool:
    """`file.py:Class` or `module:Class` (a loss name has no colon)."""
    return ":" in text


def find(text: str) -> type[Loss] | None:
    """The plugin loss `text` names (a spec, a loaded plugin's name, an entry point's name); None if none does."""
    if not is_spec(text) and text in _LOADED:
        return _LOADED[text][0]
    found = loader.find(text, KIND)
    return _register(found) if found is not None else None


def lookup(name: str) -> type[Loss] | None:
    """A built-in loss class, else the plugin `name` names; None if neither."""
    return LOSSES.find(name) or find(name)


def canonical(text: str) -> str:
    """The name a loss is known by: a spec's class's `name`, any other text as it is."""
    return load(text).name if is_spec(text) else text


def origin(name: str) -> dict | None:
    """Where plugin `name` came from (None for a built-in or an unknown name)."""
    found = _LOADED.get(name)
    return dict(found[1]) if found else None


def records(names) -> dict[str, dict]:
    """`{name: origin}` of the plugins among `names`: what config.json keeps under `plugins`."""
    return {name: origin(name) for name in names if name in _LOADED}


def loaded() -> dict[str, dict]:
    """Every plugin loaded in this process, `{name: origin}` (what a spawned worker loads again)."""
    return {name: dict(found[1]) for name, found in _LOADED.items()}


def installed() -> list[str]:
    """The names installed distributions declare in the entry-point group `spml_cache.losses`."""
    return loader.installed(KIND)


def load(spec: str) -> type[Loss]:
    """Import `path/to/file.py:Class` or `package.module:Class`, check it is a loss, register it by its name."""
    return _register(loader.load(spec, KIND))


def _register(found: loader.Loaded) -> type[Loss]:
    """Check the class against the contract's declarations and make it known by its `name`."""
    cls, spec = found.target, found.shown
    if not (inspect.isclass(cls) and issubclass(cls, Loss)) or cls is Loss:
        raise SpmlError(f"{KIND.named(spec)}: {getattr(cls, '__name__', cls)!s} is not a loss; subclass"
                        f" spml_cache.losses.Loss ({GUIDE})")
    name = cls.__dict__.get("name")
    if found.origin.kind == loader.ENTRY_POINT and name not in (None, found.origin.spec):
        raise SpmlError(f"{KIND.named(spec)}: the entry point is named {found.origin.spec!r} but the class's name is"
                        f" {name!r}; make them the same")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise SpmlError(f"{KIND.named(spec)}: set the class attribute name = \"my_loss\" (letters, digits and _,"
                        f" a letter first); it names the loss's results ({GUIDE})")
    if len(name) > NAME_MAX:
        raise SpmlError(f"{KIND.named(spec)}: its name is {len(name)} characters ({name[:16]}...); give it at most"
                        f" {NAME_MAX} (it is part of file names, which filesystems cap at 255 bytes)")
    if name in LOSSES:
        raise SpmlError(f"{KIND.named(spec)}: its name {name!r} is a built-in loss's; give the plugin another name")
    if cls.forward is Loss.forward and cls.equation is Loss.equation:  # it would raise at the first step
        raise SpmlError(f"{KIND.named(spec)}: {cls.__name__} has no forward(logits, observed, *, labels=None,"
                        f" index=None) nor equation(x, observed, *, labels=None, index=None); define one ({GUIDE})")
    before = _LOADED.get(name)
    if before is not None and before[0] is not cls:
        raise SpmlError(f"{KIND.named(spec)}: the name {name!r} is taken by the plugin {before[1]['spec']}; give one"
                        " of them another name")
    _LOADED[name] = (cls, found.origin.as_dict())
    return cls


def load_recorded(recorded: dict | None, *, run_dir: Path | str, strict: bool,
                  renewable: Callable[[str], bool] | None = None) -> dict[str, dict]:
    """Load the plugins a run's config.json records (`records`, today's keys or an earlier version's). `strict`
    (`--resume`): refuse one whose code changed since the run began (another file content, distribution version
    or spec), unless `renewable(name)` says nothing it trained was kept (a plugin fixed after it failed): it goes
    on with the code found now, whose records are returned (`{name: origin}`, for config.json)."""
    renewed = {}
    for name, record in (recorded or {}).items():
        was = Origin.read(record)
        if name not in _LOADED:
            if was.kind == "module" and not loader.findable(was.spec):  # beside the folder the run began in
                loader.on_path_again(was)
            cls = find(was.spec) if was.kind == loader.ENTRY_POINT else load(was.spec)
            if name not in _LOADED:  # the class there is named anew: the recorded loss is gone
                raise SpmlError(f"{run_dir}: its loss plugin {name} is gone ({was.spec} now names {cls.name!r});"
                                " restore it, or start a new run")
        change = was.change(Origin.read(_LOADED[name][1]))
        if strict and change is not None and renewable is not None and renewable(name):
            warnings.warn(f"--resume {run_dir}: the loss plugin {name} changed since the run began ({change}); none"
                          " of its parts was kept, so it trains with the code found now")
            renewed[name] = origin(name)
        elif strict and change is not None:
            raise SpmlError(f"--resume {run_dir}: the loss plugin {name} changed since the run began ({change});"
                            " restore it, or start a new run")
    return renewed
