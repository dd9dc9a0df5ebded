"""Backbones from outside the package: `--backbone module:callable`, `path/to/file.py:callable`, or a name an
installed distribution adds through the entry-point group `spml_cache.backbones` (docs/your-own-backbone.md states
the contract); runtime/plugins.py loads all three, for losses too.

The callable returns `(model, preprocess, width)`: an `nn.Module` mapping a normalised float `[B, 3, R, R]`
batch to `[B, width]`, a `backbones.preprocess.Preprocess` (R, mean, std, squash or resize-and-crop) and the
width. It is called with the keywords it accepts of `weights` (`--weights`, when given: `none` arrives as the
string 'none') and `resolution` (when given); a value it does not accept is refused, except a resolution that
equals its preprocessing's own (what fine-tuning passes back). The cache records where the code came from
(`backbone_origin`, runtime/plugins.py's `Origin`): the module's file and its sha256, or the entry point's
distribution and version too, so that a changed file makes another cache.
"""

from __future__ import annotations

import inspect
import socket
import urllib.error
from pathlib import Path

import torch
from torch import nn

from spml_cache.backbones import Description, Family, Request
from spml_cache.backbones.checkpoints import WEIGHTS_NONE
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.runtime import plugins as loader
from spml_cache.runtime.errors import SpmlError

OWN_WEIGHTS = "callable"  # the cache's `weights` attr when the callable loads its own (no --weights)
CONTRACT = "it must return (model, preprocess, width): docs/your-own-backbone.md"
# What a fetch that found no network raises: urllib's (torch.hub), the socket's, and by name those of the libraries
# a callable may fetch through (requests' ConnectionError, httpx's ConnectError, huggingface_hub's offline errors).
NETWORK_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError, socket.gaierror)
NETWORK_NAMES = ("ConnectionError", "ConnectError", "Timeout", "LocalEntryNotFoundError", "OfflineModeIsEnabled")


def _load(name: str) -> tuple[loader.Loaded, str]:
    """The callable `name` names (a spec, or an installed entry point's name) and the name the cache knows it
    by: the name as given, a file's without its folder (`mynets.py:fn`, the same from any folder)."""
    found = loader.find(name, loader.BACKBONES)
    if found is None:  # family_of found it installed a moment ago
        raise SpmlError(f"--backbone {name}: no installed entry point of {loader.BACKBONES.group} has this name")
    if not callable(found.target):
        raise SpmlError(f"--backbone {found.shown}: {type(found.target).__name__} is not callable; name a function"
                        f" that builds the backbone ({CONTRACT})")
    if found.origin.kind == "file":
        where, attribute = loader.split(name)
        return found, f"{Path(where).name}:{attribute}"
    return found, name


def _takes(target) -> set[str]:
    """The keywords `target` accepts of `weights` and `resolution` (both, where it takes **kwargs)."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        parameters = {}
    return set(parameters) | ({"weights", "resolution"} if any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()) else set())


def _fix(err: BaseException, takes_weights: bool) -> str:
    """What to do about the callable's failure: where it found no network (fetching weights, offline), the way out
    the built-in backbones give, through its weights parameter; else, fix it."""
    chain, seen = [], err
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    offline = any(isinstance(found, NETWORK_ERRORS) or any(name in kind.__name__ for kind in type(found).__mro__
                                                           for name in NETWORK_NAMES) for found in chain)
    if not offline:
        return "fix the callable"
    if takes_weights:
        return f"it found no network (fetching its weights?): --weights PATH if it reads a local file, {WEIGHTS_NONE}"
    return ("it found no network (fetching its weights?): give the callable a weights parameter, which --weights none"
            " reaches as 'none' (random features, to try the pipeline; docs/your-own-backbone.md), or fix the callable")


def _arguments(target, shown: str, weights: str | None, resolution: int | None) -> tuple[dict, int | None]:
    """The keywords to call `target` with, and the resolution its preprocessing must have (None: any)."""
    takes = _takes(target)
    keywords, required = {}, None
    if weights is not None and weights != OWN_WEIGHTS:
        if "weights" not in takes:
            raise SpmlError(f"--weights {weights}: the backbone {shown} takes no weights argument; leave --weights"
                            " out (it loads its own), or give the callable a weights parameter (--weights none"
                            " arrives as 'none'; docs/your-own-backbone.md)")
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


def describe(request: Request) -> Description:
    """`request.name`: a spec or an entry point's name; the callable is called here (its model kept for
    `build`), so a broken plugin is refused before anything is written."""
    found, name = _load(request.name)
    shown = found.shown
    keywords, required = _arguments(found.target, shown, request.weights, request.resolution)
    try:
        result = found.target(**keywords)
    except SpmlError:
        raise
    except (Exception, SystemExit) as err:  # the user's callable: one line naming it, never a traceback
        said = " ".join(str(err).split())
        raise SpmlError(f"--backbone {shown}: calling it raised {type(err).__name__}: {said}; "
                        f"{_fix(err, 'weights' in _takes(found.target))}") from None
    model, preprocess, width = _checked(result, shown, required)
    _output_width(model, preprocess, shown, width)
    given = keywords.get("weights", OWN_WEIGHTS)
    return Description(backbone=name, family=Plugins.name, weights=given, provenance=given, preprocess=preprocess,
                       feature_dim=width, origin=found.origin.as_json(), extra={"model": model})


def build(description: Description) -> nn.Module:
    return description.extra["model"]


class Plugins(Family):
    """The user's own backbones (docs/your-own-backbone.md)."""

    name = "plugin"
    called = "a plugin backbone (its callable gives one vector)"
    features = ("pooled",)  # its blocks are unknown here
    describe = staticmethod(describe)
    build = staticmethod(build)
