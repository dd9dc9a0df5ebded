"""Code from outside the package, for losses and backbones alike (docs/your-own-loss.md, your-own-backbone.md).

Three forms name it, for either kind:
  path/to/file.py:Name   that file, from any folder (imported under a module name of its own, from its path and
                         content hash, so that an edited file is another module)
  package.module:Name    a module on the Python path, the current folder included (as `python -m` finds one)
  NAME                   an entry point an installed distribution declares in the kind's group
                         (`spml_cache.losses`, `spml_cache.backbones`); two distributions claiming one name are
                         refused, since which one is meant cannot be known
What is loaded comes with its `Origin`, one record for both kinds: where the code came from (the file and the
sha256 of its contents, the distribution and its version). Losses keep it in a run's config.json (`plugins`),
backbones in the cache (`backbone_origin`); `Origin.read` also reads the records earlier versions wrote, and
`Origin.change` says what differs between a record and the code found now. Nothing here imports torch: a kind's
own checks (a loss's class, a backbone's callable) are its package's.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path

from spml_cache.runtime.errors import Interrupted, SpmlError, closest, stop_requested, stops_at_once


@dataclass(frozen=True, kw_only=True)
class Kind:
    """What a plugin is: how refusals name it and its flag, its entry-point group and its guide."""

    noun: str  # loss, backbone: the flag is --noun
    group: str  # the entry-point group
    guide: str  # the page that states the contract
    thing: str  # what the spec's Name is: class, callable
    placeholder: str  # how the forms show the Name: ClassName, callable

    @property
    def flag(self) -> str:
        return f"--{self.noun}"

    def named(self, spec: str) -> str:
        """How a refusal names `spec`: after its flag (`--loss x.py:A`), or as typed where it came as a command's
        argument (`check-loss x.py:A`, `losses NAME`: `given_as_argument`)."""
        return spec if _AS_ARGUMENT.get() else f"{self.flag} {spec}"


_AS_ARGUMENT: ContextVar[bool] = ContextVar("plugin_spec_as_argument", default=False)


@contextmanager
def given_as_argument():
    """Within it, refusals name a plugin spec as the user typed it, without a flag: it came as a command's
    argument (check-loss SPEC, losses NAME), where no --loss or --backbone was given."""
    token = _AS_ARGUMENT.set(True)
    try:
        yield
    finally:
        _AS_ARGUMENT.reset(token)


LOSSES = Kind(noun="loss", group="spml_cache.losses", guide="docs/your-own-loss.md", thing="class",
              placeholder="ClassName")
BACKBONES = Kind(noun="backbone", group="spml_cache.backbones", guide="docs/your-own-backbone.md", thing="callable",
                 placeholder="callable")

ENTRY_POINT = "entry_point"
# What an earlier version wrote, as it reads now: losses' kind "entry point", backbones' "file" and "name" keys.
_OLD_KINDS = {"entry point": ENTRY_POINT}
_OLD_KEYS = {"file": "path", "name": "spec"}


@dataclass(frozen=True, kw_only=True)
class Origin:
    """Where a plugin's code came from. `kind`: file, module or entry_point; `spec`: what loads it again from any
    folder (a file's absolute `path:Name`, `module:Name`, the entry point's name); `path` and `sha256`: the module
    file and its contents; `module`: a module spec's module; `value`: the entry point's `module:Name`;
    `distribution` and `version`: the installed distribution that provides it."""

    kind: str
    spec: str
    path: str | None = None
    sha256: str | None = None
    module: str | None = None
    value: str | None = None
    distribution: str | None = None
    version: str | None = None

    # The keys that say which code it is: a file moved with the same contents is the same code.
    IDENTITY = ("kind", "spec", "value", "sha256", "distribution", "version")

    @classmethod
    def read(cls, record: dict | str) -> Origin:
        """A stored record (a dict, or its JSON as a cache attr holds it), today's keys or an earlier version's."""
        found = json.loads(record) if isinstance(record, str) else dict(record)
        for old, new in _OLD_KEYS.items():
            if old in found and new not in found:
                found[new] = found.pop(old)
        found["kind"] = _OLD_KINDS.get(found.get("kind"), found.get("kind"))
        known = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in found.items() if key in known and value is not None})

    def as_dict(self) -> dict:
        """The stored record: the keys that have a value, in the order above."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    def as_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    def text(self) -> str:
        """In words, for listings and refusals: what loads it, its distribution, its file and hash."""
        parts = [f"entry point {self.spec} = {self.value}" if self.kind == ENTRY_POINT else self.spec]
        parts += [f"{self.distribution} {self.version}"] if self.distribution else []
        parts += [self.path] if self.path and self.kind != "file" else []  # a file's spec holds its path
        parts += [f"sha256 {self.sha256[:12]}"] if self.sha256 else []
        return ", ".join(parts)

    def change(self, now: Origin) -> str | None:
        """What differs from `self` (a stored record) in `now` (the code found now), in words, or None. A key the
        stored record lacks is not compared: an earlier version did not record it."""
        for key in self.IDENTITY:
            then, found = getattr(self, key), getattr(now, key)
            if then is not None and then != found:
                return f"{key} {str(then)[:16]} then, {str(found)[:16]} now: {now.path or now.spec}"
        return None


@dataclass(frozen=True)
class Loaded:
    """What a spec or an entry point named: the object, where it came from, and how refusals name it."""

    target: object
    origin: Origin
    shown: str  # the spec as given, or `NAME (entry point VALUE of DIST VERSION)`


def split(text: str) -> tuple[str, str] | None:
    """(where, Name) of `where:Name`, or None for text without a colon."""
    where, colon, name = text.rpartition(":")
    return (where, name) if colon else None


def is_file(where: str) -> bool:
    """Whether a spec's `where` is a file's path (`x.py`, `dir/x`) rather than a module's dotted name."""
    return where.endswith(".py") or "/" in where or os.sep in where


def findable(text: str) -> bool:
    """Whether `text` is a spec that names a file, a dotted module, or a module found on the Python path (the
    current folder included), without importing it."""
    found = split(text)
    if found is None or not found[0] or not found[1].isidentifier():
        return False
    where = found[0]
    if is_file(where) or "." in where:
        return True
    _with_current_folder()
    try:
        return importlib.util.find_spec(where) is not None
    except (ImportError, ValueError):
        return False


def load(spec: str, kind: Kind) -> Loaded:
    """Import `path/to/file.py:Name` or `package.module:Name` and find Name there."""
    found = split(spec)
    if found is None or not found[0] or not found[1].isidentifier():
        raise SpmlError(f"{kind.named(spec)}: expected path/to/file.py:{kind.placeholder} or"
                        f" package.module:{kind.placeholder} ({kind.guide})")
    where, name = found
    if is_file(where):
        module = _import_file(spec, Path(where), kind)
        origin = Origin(kind="file", spec=f"{Path(module.__file__).resolve()}:{name}", **_file_origin(module))
    else:
        module = _import_module(spec, where, kind)
        origin = Origin(kind="module", spec=spec, module=where, **_file_origin(module), **_distribution(module))
    if not hasattr(module, name):
        close = closest(name, _defined(module))
        raise SpmlError(f"{kind.named(spec)}: {where} defines no {name}" + (f" (did you mean {close}?)" if close else "")
                        + f"; name a {kind.thing} it defines ({kind.guide})")
    return Loaded(getattr(module, name), origin, spec)


def _defined(module) -> list[str]:
    """The classes and functions `module` defines itself (not those it imports): what a spec may name there."""
    return [key for key, value in vars(module).items()
            if callable(value) and getattr(value, "__module__", None) == module.__name__]


def entry_point(name: str, kind: Kind) -> metadata.EntryPoint | None:
    """The installed entry point `name` of the kind's group, None if there is none; two distributions naming it
    are refused."""
    found = [point for point in metadata.entry_points(group=kind.group) if point.name == name]
    if len(found) > 1:
        owners = ", ".join(f"{point.value} ({_owner(point)})" for point in found)
        raise SpmlError(f"{kind.named(name)}: {len(found)} installed entry points of {kind.group} have this name"
                        f" ({owners}); name one as {kind.named(f'module:{kind.placeholder}')}, or uninstall the other")
    return found[0] if found else None


def installed(kind: Kind) -> list[str]:
    """The names installed distributions declare in the kind's group, sorted (nothing is imported)."""
    return sorted({point.name for point in metadata.entry_points(group=kind.group)})


def load_entry_point(point: metadata.EntryPoint, kind: Kind) -> Loaded:
    """The object entry point `point` names; its origin is the entry point's with its module's file."""
    shown = f"{point.name} (entry point {point.value} of {_owner(point)})"
    with importing(shown, kind):
        target = point.load()
    module = sys.modules.get(getattr(target, "__module__", None) or "") or sys.modules.get(point.module)
    distribution = {"distribution": point.dist.name, "version": point.dist.version} if point.dist else {}
    origin = Origin(kind=ENTRY_POINT, spec=point.name, value=point.value, **_file_origin(module), **distribution)
    return Loaded(target, origin, shown)


def find(text: str, kind: Kind) -> Loaded | None:
    """What `text` names: a spec (it holds a colon), else an installed entry point's name; None if neither."""
    if split(text) is not None:
        return load(text, kind)
    point = entry_point(text, kind)
    return load_entry_point(point, kind) if point is not None else None


def missing(origin: Origin, kind: Kind) -> str | None:
    """Why the code a record names cannot be loaded here, with the fix (None: it can); nothing is imported."""
    if origin.kind == ENTRY_POINT:
        if entry_point(origin.spec, kind) is None:
            return f"no installed entry point of {kind.group} is named {origin.spec}: install {origin.distribution}"
        return None
    where = split(origin.spec)[0]
    if origin.kind == "file" and not Path(where).is_file():
        return f"its file {where} is gone: restore it"
    if origin.kind != "file" and not (findable(origin.spec) or on_path_again(origin)):
        folder = f"{Path(origin.path).parent}" if origin.path else "the folder that holds it"
        return (f"its module {where} is not on the Python path here: run from {folder}, or add that folder to"
                " PYTHONPATH")
    return None


def on_path_again(origin: Origin) -> bool:
    """A recorded `module:Name` that is not on the Python path here, made importable from the folder its recorded
    file lies under (a run resumed from another folder than the one beside its plugin module, or a cache's plugin
    backbone used from elsewhere), that folder put last on the path; whether it was. The module keeps its name, and
    its contents are the record's to check (`Origin.change`)."""
    if origin.kind != "module" or not origin.path or not origin.module or not Path(origin.path).is_file():
        return False
    file, parts = Path(origin.path), origin.module.split(".")
    named = file.parent if file.name == "__init__.py" else file.with_suffix("")  # the module's own path, dotted
    if named.parts[-len(parts):] != tuple(parts):
        return False  # the record's file is not that module's (moved, or a path entry of its own)
    root = str(Path(*named.parts[:-len(parts)]))
    if root not in sys.path:
        sys.path.append(root)
        importlib.invalidate_caches()
    return findable(origin.spec)


@contextmanager
def importing(shown: str, kind: Kind):
    """A plugin's import: code with no safe points (it may never return), so a signal stops it at once, even where
    the command defers stops to its own safe points (stage two); a stop there is said naming the plugin, and
    whatever the plugin raises itself (a KeyboardInterrupt or SystemExit too) is one line naming it."""
    try:
        with stops_at_once():
            yield
    except KeyboardInterrupt:
        if stop_requested() is None:  # no signal asked for it: the plugin raised it itself
            raise import_failed(shown, KeyboardInterrupt(), kind) from None
        raise Interrupted(f"nothing was written ({kind.named(shown)} was being imported)") from None
    except (Exception, SystemExit) as err:
        raise import_failed(shown, err, kind) from None


def import_failed(shown: str, err: BaseException, kind: Kind) -> SpmlError:
    said = " ".join(str(err).split())  # one line, whatever the message holds
    raised = f"{type(err).__name__}: {said}" if said else type(err).__name__
    return SpmlError(f"{kind.named(shown)}: importing it raised {raised}; fix the plugin (run it with python to see"
                     " the traceback)")


def _import_file(spec: str, path: Path, kind: Kind):
    if not path.is_file():
        raise SpmlError(f"{kind.named(spec)}: no file {path}; give the path of a .py file that defines the"
                        f" {kind.noun} ({kind.guide})")
    path = path.resolve()
    key = hashlib.sha256(f"{path}\0{_digest(path)}".encode()).hexdigest()[:12]
    module_name = f"spml_cache_plugin_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{key}"
    if module_name in sys.modules:  # the same file with the same contents: loaded once per process
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # a class's module must be importable by name (pickling, dataclasses)
    try:
        with importing(spec, kind):
            module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _with_current_folder() -> None:
    """The current folder on the Python path, last, as `python -m` would have it: a module beside the user."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def _import_module(spec: str, module_name: str, kind: Kind):
    _with_current_folder()
    try:
        with importing(spec, kind):
            return importlib.import_module(module_name)
    except SpmlError as failed:
        err = failed.__context__
        if isinstance(err, ModuleNotFoundError) and err.name and (module_name == err.name or
                                                                   module_name.startswith(f"{err.name}.")):
            raise SpmlError(f"{kind.named(spec)}: no module {err.name} on the Python path (the current folder"
                            " included); install its package, run from the folder that holds it, or add that"
                            f" folder to PYTHONPATH ({kind.guide})") from None
        raise


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_origin(module) -> dict:
    """The module's file and the sha256 of its contents (none for a module without a file)."""
    file = getattr(module, "__file__", None)
    if not file or not Path(file).is_file():
        return {}
    return {"path": str(Path(file).resolve()), "sha256": _digest(Path(file))}


def _distribution(module) -> dict:
    """The installed distribution that provides the module, with its version (none for a loose file)."""
    top = module.__name__.partition(".")[0]
    for name in metadata.packages_distributions().get(top, []):
        try:
            return {"distribution": name, "version": metadata.version(name)}
        except metadata.PackageNotFoundError:
            continue
    return {}


def _owner(point: metadata.EntryPoint) -> str:
    return f"{point.dist.name} {point.dist.version}" if point.dist is not None else "an unknown distribution"
