"""Losses from outside the package (docs/your-own-loss.md): `path/to/file.py:Class`, `package.module:Class`, or a
name an installed distribution declares in the entry-point group `spml_cache.losses`.

A plugin is a subclass of `spml_cache.losses.Loss` with its own `name`, which is what results, run directories and
the report call it. Its origin (the file and its content hash, or the distribution and its version) goes into
config.json (`records`), so that `--resume` loads the very same code again or refuses (`load_recorded`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from importlib import metadata
from pathlib import Path

from spml_cache.losses.base import LOSSES, Loss
from spml_cache.runtime.errors import SpmlError

GROUP = "spml_cache.losses"
GUIDE = "docs/your-own-loss.md"
NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # a result key, a file stem and an --hp prefix as it is

_LOADED: dict[str, tuple[type[Loss], dict]] = {}  # loss name -> (class, origin)


def is_spec(text: str) -> bool:
    """`file.py:Class` or `module:Class` (a loss name has no colon)."""
    return ":" in text


def find(text: str) -> type[Loss] | None:
    """The plugin loss `text` names (a spec, a loaded plugin's name, an entry point's name); None if none does."""
    if is_spec(text):
        return load(text)
    if text in _LOADED:
        return _LOADED[text][0]
    point = _entry_points().get(text)
    return _load_entry_point(point) if point is not None else None


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
    return sorted(_entry_points())


def load(spec: str) -> type[Loss]:
    """Import `path/to/file.py:Class` or `package.module:Class`, check it is a loss, register it by its name."""
    where, _, class_name = spec.rpartition(":")
    if not where or not class_name.isidentifier():
        raise SpmlError(f"--loss {spec}: expected path/to/file.py:ClassName or package.module:ClassName ({GUIDE})")
    if _is_path(where):
        module, found = _import_file(spec, Path(where)), {"kind": "file"}
    else:
        module, found = _import_module(spec, where), {"kind": "module", "module": where}
    cls = getattr(module, class_name, None)
    if cls is None:
        raise SpmlError(f"--loss {spec}: {where} defines no {class_name}; name a class it defines ({GUIDE})")
    found.update(_file_origin(module), spec=_stored_spec(spec, where, class_name, module), **_distribution(module))
    return _register(spec, cls, found)


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise SpmlError(f"--loss {spec}: no file {path}; give the path of a .py file that defines the loss ({GUIDE})")
    path = path.resolve()
    key = hashlib.sha256(f"{path}\0{_digest(path)}".encode()).hexdigest()[:12]
    module_name = f"spml_cache_plugin_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{key}"
    if module_name in sys.modules:  # the same file with the same contents: loaded once per process
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # a class's module must be importable by name (pickling, dataclasses)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise _import_failed(spec, err) from None
    return module


def _import_module(spec: str, module_name: str):
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would: a module beside the user
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise SpmlError(f"--loss {spec}: no module {module_name} on the Python path; install its package or"
                            f" run from the folder that holds it ({GUIDE})") from None
        raise _import_failed(spec, err) from None
    except Exception as err:
        raise _import_failed(spec, err) from None


def _import_failed(spec: str, err: Exception) -> SpmlError:
    return SpmlError(f"--loss {spec}: importing it raised {type(err).__name__}: {err}; fix the plugin (run it with"
                     " python to see the traceback)")


def _register(spec: str, cls, found: dict) -> type[Loss]:
    """Check `cls` against the contract's declarations and make it known by its `name`."""
    if not (inspect.isclass(cls) and issubclass(cls, Loss)) or cls is Loss:
        raise SpmlError(f"--loss {spec}: {getattr(cls, '__name__', cls)!s} is not a loss; subclass"
                        f" spml_cache.losses.Loss ({GUIDE})")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise SpmlError(f"--loss {spec}: set the class attribute name = \"my_loss\" (letters, digits and _,"
                        f" a letter first); it names the loss's results ({GUIDE})")
    if name in LOSSES:
        raise SpmlError(f"--loss {spec}: its name {name!r} is a built-in loss's; give the plugin another name")
    if cls.forward is Loss.forward:  # torch's placeholder, which raises at the first step
        raise SpmlError(f"--loss {spec}: {cls.__name__} has no forward(logits, observed, *, labels=None,"
                        f" index=None); define it ({GUIDE})")
    before = _LOADED.get(name)
    if before is not None and before[0] is not cls:
        raise SpmlError(f"--loss {spec}: the name {name!r} is taken by the plugin {before[1]['spec']}; give one"
                        " of them another name")
    _LOADED[name] = (cls, found)
    return cls


def _entry_points() -> dict:
    return {point.name: point for point in metadata.entry_points(group=GROUP)}


def _load_entry_point(point) -> type[Loss]:
    spec = f"{point.name} (entry point {point.value}"
    spec += f" of {point.dist.name} {point.dist.version})" if point.dist is not None else ")"
    try:
        cls = point.load()
    except Exception as err:
        raise _import_failed(spec, err) from None
    module = sys.modules.get(getattr(cls, "__module__", ""), None)
    found = {"kind": "entry point", "spec": point.name, "value": point.value,
             **(_file_origin(module) if module is not None else {})}
    if point.dist is not None:
        found.update(distribution=point.dist.name, version=point.dist.version)
    if inspect.isclass(cls) and cls.__dict__.get("name") not in (None, point.name):
        raise SpmlError(f"--loss {spec}: the entry point is named {point.name!r} but the class's name is"
                        f" {cls.__dict__.get('name')!r}; make them the same")
    return _register(spec, cls, found)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_origin(module) -> dict:
    """The module's file and the sha256 of its contents (none for a module without a file)."""
    file = getattr(module, "__file__", None)
    if not file or not Path(file).is_file():
        return {}
    return {"path": str(Path(file).resolve()), "sha256": _digest(Path(file))}


def _stored_spec(spec: str, where: str, class_name: str, module) -> str:
    """The spec that loads the same class from any folder: a file's absolute path, a module's name."""
    return f"{Path(module.__file__).resolve()}:{class_name}" if _is_path(where) else spec


def _is_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def _distribution(module) -> dict:
    """The installed distribution that provides the module, with its version (none for a loose file)."""
    top = module.__name__.partition(".")[0]
    for name in metadata.packages_distributions().get(top, []):
        try:
            return {"distribution": name, "version": metadata.version(name)}
        except metadata.PackageNotFoundError:
            continue
    return {}


def load_recorded(recorded: dict | None, *, run_dir: Path | str, strict: bool) -> None:
    """Load the plugins a run's config.json records (`records`). `strict` (`--resume`): refuse one whose code
    changed since the run began (another file content, distribution version or class)."""
    for name, was in (recorded or {}).items():
        if name in _LOADED:
            now = _LOADED[name][1]
        else:
            found = find(was["spec"]) if was.get("kind") == "entry point" else load(was["spec"])
            now = _LOADED[found.name][1]
        if not strict:
            continue
        for key in ("sha256", "version", "distribution", "spec"):
            if was.get(key) != now.get(key):
                then, now = (str(value)[:16] for value in (was.get(key), now.get(key)))
                raise SpmlError(f"--resume {run_dir}: the loss plugin {name} changed since the run began ({key}"
                                f" {then} then, {now} now: {was.get('path') or was['spec']}); restore it, or"
                                " start a new run")
