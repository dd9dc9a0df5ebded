"""Backbones from outside the package: `--backbone module:callable`, or a name an installed distribution adds
through the entry-point group `spml_cache.backbones` (docs/your-own-backbone.md states the contract).

The callable returns `(model, preprocess, width)`: an `nn.Module` mapping a normalised float `[B, 3, R, R]`
batch to `[B, width]`, a `backbones.preprocess.Preprocess` (R, mean, std, squash or resize-and-crop) and the
width. It is called with the keywords it accepts of `weights` (`--weights`, when given) and `resolution` (when
given); a value it does not accept is refused, except a resolution that equals its preprocessing's own (what
fine-tuning passes back). The cache records where the code came from (`origin`): the module's file and its
sha256, or the entry point's distribution and version, so that a changed file makes another cache.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import re
from pathlib import Path

import torch
from torch import nn

from spml_cache.backbones import PLUGIN, Description
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.runtime.errors import SpmlError

GROUP = "spml_cache.backbones"
OWN_WEIGHTS = "callable"  # the cache's `weights` attr when the callable loads its own (no --weights)
MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
CONTRACT = "it must return (model, preprocess, width): docs/your-own-backbone.md"


def is_spec(name: str) -> bool:
    """Whether `name` is `module:callable` with an importable module (a dotted path, or one found on sys.path)."""
    module, colon, attribute = name.partition(":")
    if not colon or not MODULE_PATH.fullmatch(module) or not attribute.isidentifier():
        return False
    if "." in module:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def entry_point(name: str) -> importlib.metadata.EntryPoint | None:
    """The installed entry point `name` of the group, None if there is none; two distributions naming it are
    refused (which one would be meant is not knowable)."""
    found = [point for point in importlib.metadata.entry_points(group=GROUP) if point.name == name]
    if len(found) > 1:
        owners = ", ".join(f"{point.value} ({_distribution(point)})" for point in found)
        raise SpmlError(f"--backbone {name}: {len(found)} installed entry points of {GROUP} have this name ({owners});"
                        " name one as --backbone module:callable, or uninstall the other")
    return found[0] if found else None


def _distribution(point: importlib.metadata.EntryPoint) -> str:
    dist = point.dist
    return f"{dist.metadata['Name']} {dist.version}" if dist is not None else "unknown distribution"


def _file_origin(module) -> dict:
    path = Path(getattr(module, "__file__", None) or "")
    if not path.is_file():
        return {"module": module.__name__, "file": None, "sha256": None}
    return {"module": module.__name__, "file": str(path.resolve()),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _load(spec: str, shown: str):
    """The object `module:attribute` names, any failure to import it as one line naming `shown`."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise SpmlError(f"--backbone {shown}: no module {err.name} on the path: install it, or add its folder"
                            " to PYTHONPATH") from None
        raise SpmlError(f"--backbone {shown}: importing {module_name} failed: {err}; fix the module") from None
    except Exception as err:  # the user's code raised at import: whatever it is, it is theirs to fix
        raise SpmlError(f"--backbone {shown}: importing {module_name} raised {type(err).__name__}: {err};"
                        " fix the module") from None
    target = getattr(module, attribute, None)
    if not callable(target):
        raise SpmlError(f"--backbone {shown}: {module_name} has no callable {attribute}; name a function that"
                        f" builds the backbone ({CONTRACT})")
    return module, target


def _arguments(target, shown: str, weights: str | None, resolution: int | None) -> tuple[dict, int | None]:
    """The keywords to call `target` with, and the resolution its preprocessing must have (None: any)."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        parameters = {}
    takes = set(parameters) | ({"weights", "resolution"} if any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()) else set())
    keywords, required = {}, None
    if weights is not None and weights != OWN_WEIGHTS:
        if "weights" not in takes:
            raise SpmlError(f"--weights {weights}: the backbone {shown} takes no weights argument; leave --weights"
                            " out (it loads its own)")
        keywords["weights"] = weights
    if resolution is not None:
        if "resolution" in takes:
            keywords["resolution"] = resolution
        required = resolution
    return keywords, required


def _checked(result, shown: str, required: int | None) -> tuple[nn.Module, Preprocess, int]:
    if not (isinstance(result, tuple) and len(result) == 3):
        raise SpmlError(f"--backbone {shown}: returned {type(result).__name__}, not a tuple of three; {CONTRACT}")
    model, preprocess, width = result
    if not isinstance(model, nn.Module):
        raise SpmlError(f"--backbone {shown}: its model is a {type(model).__name__}, not a torch.nn.Module; {CONTRACT}")
    if not isinstance(preprocess, Preprocess):
        raise SpmlError(f"--backbone {shown}: its preprocess is a {type(preprocess).__name__}, not a"
                        f" spml_cache.backbones.preprocess.Preprocess; {CONTRACT}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise SpmlError(f"--backbone {shown}: its width {width!r} is not a positive int; {CONTRACT}")
    if required is not None and preprocess.resolution != required:
        raise SpmlError(f"--resolution {required}: the backbone {shown} takes no resolution argument and its"
                        f" preprocessing is {preprocess.resolution}; leave --resolution out")
    return model, preprocess, width


def _output_width(model: nn.Module, preprocess: Preprocess, shown: str, width: int) -> None:
    """One forward pass of a blank image: a model whose rows are not `[1, width]` is refused before extraction."""
    training = model.training
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros(1, 3, preprocess.resolution, preprocess.resolution))
    except Exception as err:  # the user's forward: any failure is theirs to fix, said in one line
        raise SpmlError(f"--backbone {shown}: its model failed on a [1, 3, {preprocess.resolution},"
                        f" {preprocess.resolution}] batch ({type(err).__name__}: {err}); {CONTRACT}") from None
    finally:
        model.train(training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, width):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise SpmlError(f"--backbone {shown}: its model maps a [1, 3, R, R] batch to {shape}, not (1, {width}) as"
                        f" its width says; {CONTRACT}")


def describe(name: str, weights: str | None, resolution: int | None) -> Description:
    """`name`: `module:callable`, or an entry point's name; the callable is called here (its model kept for
    `build`), so a broken plugin is refused before anything is written."""
    point = None if is_spec(name) else entry_point(name)
    if point is None:
        module, target = _load(name, name)
        origin = {"kind": "module", "spec": name, **_file_origin(module)}
    else:
        module, target = _load(point.value, f"{name} (entry point {point.value})")
        origin = {"kind": "entry_point", "name": name, "value": point.value, "distribution":
                  point.dist.metadata["Name"] if point.dist else None,
                  "version": point.dist.version if point.dist else None}
    keywords, required = _arguments(target, name, weights, resolution)
    try:
        result = target(**keywords)
    except SpmlError:
        raise
    except Exception as err:  # the user's callable: one line naming it, never a traceback
        raise SpmlError(f"--backbone {name}: calling it raised {type(err).__name__}: {err}; fix the callable") from None
    model, preprocess, width = _checked(result, name, required)
    _output_width(model, preprocess, name, width)
    given = keywords.get("weights", OWN_WEIGHTS)
    return Description(name, PLUGIN, given, given, preprocess, width, origin=json.dumps(origin, sort_keys=True),
                       extra={"model": model})


def build(description: Description) -> nn.Module:
    return description.extra["model"]
