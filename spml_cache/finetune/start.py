"""Stage three's starting point (LinearInit, Cole et al. 2021): the cache it reads and which linear run's head it
starts from (`starting_point`), the checks that head must pass against the cache, the trunk that made the cache
(`trunk_backbone`), and ROLE's label matrix carried over with it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spml_cache import backbones, cache, losses, observation, runs
from spml_cache.backbones.resnet50 import WEIGHT_NAMES
from spml_cache.losses import plugins as loss_plugins
from spml_cache.observation import split_key
from spml_cache.options import FinetuneOptions
from spml_cache.runtime import plugins
from spml_cache.runtime.errors import SpmlError, closest
from spml_cache.runtime.plugins import Origin

THETA_CLIP = 1e-5


def role_theta_handover(theta: torch.Tensor) -> torch.Tensor:
    """ROLE's label logits carried into fine-tuning: logit(clip(Q, 1e-5, 1 - 1e-5)) with Q = sigmoid(theta)."""
    q = torch.sigmoid(theta.double()).clamp(THETA_CLIP, 1 - THETA_CLIP)
    return torch.logit(q).to(theta.dtype)


def default_weights(cache_attrs: dict) -> str | None:
    """The weights that made the cache when they have a name (what LinearInit needs), else the backbone's
    default (IMAGENET1K_V1 for ResNet-50; None: the registry's default for the others)."""
    weights = str(cache_attrs.get("weights", ""))
    if cache_attrs.get("backbone", backbones.DEFAULT) != backbones.DEFAULT:
        return None if weights.startswith("sha256:") or not weights else weights
    return weights if weights in (*WEIGHT_NAMES, "none") else "IMAGENET1K_V1"


def trunk_backbone(cache_attrs: dict, weights: str | None, resolution: int) -> backbones.Description:
    """The backbone that made the cache (its `backbone` attr; a plugin loaded again from its recorded origin,
    `backbone_origin`), with `weights` (None: those that made the cache where they have a name, else the
    backbone's default), at side `resolution`: what fine-tuning trains end to end. A family that stage three does
    not train (CLIP's image towers) is refused in one line."""
    name = str(cache_attrs.get("backbone", backbones.DEFAULT))
    stored = cache_attrs.get("backbone_origin")
    recorded = Origin.read(stored) if stored else None
    why = plugins.missing(recorded, plugins.BACKBONES) if recorded else None
    if why is not None:
        raise SpmlError(f"finetune: the cache's backbone {name} ({recorded.text()}) cannot be loaded here: {why}")
    loads = recorded.spec if recorded else name  # a plugin file's absolute path: found from any folder
    family = backbones.family(loads)
    if not family.fine_tunes:
        raise SpmlError(f"finetune: the cache's backbone {name} is {family.called}, which spml-cache does not"
                        " fine-tune end to end; train linear heads on its cache (spml-cache linear), or extract"
                        " with a torchvision or timm backbone to fine-tune")
    features = cache_attrs.get("features") or backbones.DEFAULT_FEATURES
    if features != backbones.DEFAULT_FEATURES:
        raise SpmlError(f"finetune: the cache holds {features} features, which a head fine-tuned end to end does not"
                        f" read (it reads the pooled vector): fine-tune from a cache of {name} extracted with"
                        " --features pooled (the default)")
    described = backbones.describe(loads, default_weights(cache_attrs) if weights is None else weights, resolution)
    if recorded is not None:
        change = recorded.change(Origin.read(described.origin)) if described.origin else "it is no plugin now"
        if change is not None:
            raise SpmlError(f"finetune: the backbone {name} is not the code that made the cache ({change}); restore"
                            " that code, or extract the cache again with this one")
    return described


def starting_point(options: FinetuneOptions, out: Path, cache_dir: Path | None):
    """`(features, head)`: the cache fine-tuning reads (under the observation rule of the head, or of `--loss
    loss@rule`) and, for LinearInit, the linear head it starts from (checked to fit), None for a fresh head."""
    best = options.value("init") == "best"
    if options.loss is not None and not best:
        losses.get(split_key(options.loss)[0])  # a misspelt name fails here, with a suggestion
    if not best and options.from_run is not None:
        raise SpmlError("--from RUN names a linear run to start from: it goes with --init best, not --init imagenet")
    features = cache.load(options.cache) if options.cache is not None else None
    start = None
    if best:
        dataset = features.dataset if features is not None else options.dataset
        try:
            start = choose_head(options.from_run, options.loss, dataset,
                                cache.cache_id(features.attrs) if features is not None else None, out)
        except SpmlError:
            if options.loss is not None and _misspelt(split_key(options.loss)[0]):
                losses.get(split_key(options.loss)[0])  # said as a misspelling, with its suggestion, not as "no run"
            raise
    elif options.loss is None:
        raise SpmlError("--loss NAME is needed with --init imagenet (spml-cache losses lists the names)")
    if features is None:
        features = cache.load((start and start.cache) or cache.find_cache(None, options.dataset, cache_dir))
    if options.dataset is not None and options.dataset != features.dataset:
        raise SpmlError(f"--dataset {options.dataset} but {features.path} holds {features.dataset}:"
                        " drop one of them")
    if start is not None:
        check_head(start, features)
    rule = start.rule if start is not None else split_key(options.loss)[1]
    return observation.with_rule(features, observation.parse_rule(rule, flag="--loss")), start


def _misspelt(name: str) -> bool:
    """A name that is no built-in loss but close to one (a plugin's name is known only once a run recorded it)."""
    return name not in losses.names() and closest(name, losses.names()) is not None


def choose_head(from_run: Path | None, loss: str | None, dataset: str | None, cache_id: str | None,
                runs_root: Path) -> runs.LinearHead:
    """`--init best`: loss `loss`'s head of linear run `from_run` (its best single-positive head without a
    loss), else of the newest finished linear run of `dataset` and `loss` under `runs_root` (on that cache)."""
    if from_run is not None:
        return runs.read_linear_head(Path(from_run), loss)
    if dataset is None or loss is None:
        raise SpmlError("--init best needs --loss and --dataset (or --cache) to find the newest linear run,"
                        " or --from RUN")
    newest = runs.newest_run(runs_root, dataset, "linear", loss=loss, cache=cache_id)
    if newest is None:
        where = f"{Path(runs_root) / dataset}" + (f" on cache {cache_id}" if cache_id else "")
        raise SpmlError(
            f"no finished linear run of loss {loss} for {dataset} under {where}: create one with"
            f" `spml-cache linear --loss {loss} --dataset {dataset}` (or --cache FILE), or pass --from RUN or"
            " --init imagenet"
        )
    return runs.read_linear_head(newest, loss)


def check_head(head: runs.LinearHead, features: cache.FeatureSet) -> None:
    """A head (and ROLE's theta) must come from the cache's dataset and classes, and fit the cache."""
    num_classes, num_train, cache_path = len(features.classes), len(features.train), features.path
    if head.dataset not in (None, features.dataset) or (head.classes and list(head.classes) != features.classes):
        theirs = head.classes or []
        raise SpmlError(
            f"--from {head.run}: its heads were trained on {head.dataset} ({', '.join(map(str, theirs[:3]))}, ...)"
            f" but {cache_path} holds {features.dataset} ({', '.join(features.classes[:3])}, ...): fine-tune with"
            " the cache that run used, or a linear run on this one"
        )
    rows, width = head.weight.shape
    feature_dim = features.train.features.shape[1]
    if rows != num_classes or width != feature_dim:
        raise SpmlError(
            f"{head.run / 'best.pt'}: the {head.loss} head is [{rows}, {width}] but {cache_path} has {num_classes}"
            f" classes of {feature_dim}-d features: fine-tune with the cache that run used, or re-run"
            " spml-cache linear on this one"
        )
    theta = head.loss_state.get("theta")
    if theta is not None and tuple(theta.shape[-2:]) != (num_train, num_classes):
        raise SpmlError(
            f"{head.run / 'best.pt'}: ROLE's theta is {tuple(theta.shape)} but {cache_path} has {num_train} training"
            " rows: fine-tune with the cache that run used"
        )
    runs.check_same_cache(head, cache.cache_id(features.attrs), cache_path)
    check_same_loss_code(head)


def check_same_loss_code(head: runs.LinearHead) -> None:
    """A plugin loss fine-tunes with the code that trained its head: the linear run's record of it (config.json's
    `plugins`) against the code loaded now, as `linear --resume` compares them."""
    config = runs.read_json(head.run / "config.json", dict) if (head.run / "config.json").exists() else {}
    recorded, now = (config.get("plugins") or {}).get(head.loss), loss_plugins.origin(head.loss)
    change = Origin.read(recorded).change(Origin.read(now)) if recorded and now else None
    if change is not None:
        raise SpmlError(f"--loss {head.loss}: the loss plugin changed since linear run {head.run} trained its head"
                        f" ({change}); restore it, or train a new linear run with it")
