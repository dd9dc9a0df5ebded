"""Each step of a plan checked before anything runs: every value by its option's declaration (the one line it gives
a flag, naming the key instead), what a stage needs (extract's dataset, linear's loss), the names its registries
know (datasets, losses, backbones), and the objects its door takes (`step_objects`), built as the command line
builds them."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from spml_cache.experiments.file import Given, Mistakes
from spml_cache.experiments.stages import Pending
from spml_cache.options import Options, from_flag_keywords
from spml_cache.runtime.errors import SpmlError

REQUIRED = {"extract": ("dataset", "NAME, here, at the top of the file or as an axis"),
            "import-features": ("folder", "DIR, the folder of features to import"),
            "linear": ("loss", "a name, a list or \"all\"")}
PENDING = Path("pending")  # stands for what an earlier step makes, while the plan is checked


def step_objects(step, products: Mapping[int, Path] | None = None) -> list[Options]:
    """The options objects of `step`'s door, as its command line gives them (`products`: what earlier steps made;
    None: a stand-in for each, to check the rest)."""
    values = step.resolved(products or {})
    if products is None:
        values = {key: PENDING if _pending(value) else [PENDING] if isinstance(value, list) and value and all(
            _pending(one) for one in value) else value for key, value in values.items()}
    return from_flag_keywords(f"[{step.table.name}]", values, *step.stage.types)


def _pending(value) -> bool:
    return isinstance(value, Pending)


def check_step(step, mistakes: Mistakes | None) -> bool:
    """Every value of `step` by its declaration, then what its stage needs, one mistake per line (`mistakes`
    None: only whether each value is good)."""
    options = step.stage.options()
    bad = False
    for keyword, value in step.values.items():
        given = step.given.get(keyword)
        if given is None or _pending(value):
            continue
        try:
            options[keyword].checked(value, given.key)
        except SpmlError as err:
            if mistakes is not None:
                mistakes.add(given.line, given.said(str(err)))
            bad = True
    if mistakes is None:
        return not bad
    needed = REQUIRED.get(step.stage.command)
    if needed and needed[0] not in step.values:
        mistakes.add(step.table.line, f"[{step.table.name}] no {needed[0]}: give {needed[0]} = {needed[1]}")
        return False
    if bad:
        return False
    try:
        step_objects(step)
        if step.stage.command == "linear":
            _losses(step.values["loss"], step.values.get("observe"))
    except SpmlError as err:
        _blame(step, err, "loss" if step.stage.command == "linear" else None, mistakes)
        return False
    return True


def _blame(step, err: SpmlError, keyword: str | None, mistakes: Mistakes) -> None:
    """A refusal of `step`'s values together, on the line of `keyword` (else its table's)."""
    given: Given | None = step.given.get(keyword) if keyword else None
    if given is None:
        mistakes.add(step.table.line, f"[{step.table.name}] {err}")
    else:
        mistakes.add(given.line, given.said(f"{given.key}: {err}"))


def _losses(loss, observe) -> tuple[list[str], list[str]]:
    """The losses a linear step trains (`all` as those it names) and its rules' texts."""
    from spml_cache import observation
    from spml_cache.options.linear import resolve_losses
    from spml_cache.options.text import parse_names

    names = resolve_losses(parse_names(loss) if isinstance(loss, str) else list(loss))
    return names, [rule.text for rule in observation.parse_rules(observe)]


def trains(step, key: str) -> bool:
    """Whether linear `step` trains result `key` (a loss, or `loss@rule`), as the head a fine-tuning takes."""
    from spml_cache import losses
    from spml_cache.observation import parse_rule, split_key

    try:
        names, rules = _losses(step.values["loss"], step.values.get("observe"))
        loss, rule = split_key(key)
        return losses.get(loss).name in names and parse_rule(rule).text in rules
    except (SpmlError, KeyError):  # said where the linear step or the fine-tuning's loss is checked
        return True


def planned_cache(step, mistakes: Mistakes) -> Path | None:
    """The cache an extract step writes, known before it runs: what extract names it (its backbone's slug and
    resolution, `--out`), so that the steps after it read it and a dry run shows it."""
    from spml_cache import backbones, datasets
    from spml_cache.extract.plan import output_path

    values = step.values
    if "dataset" not in values or not check_step(step, None):  # a bad value: said by its key, where it is checked
        return None
    try:
        dataset = datasets.reader(values["dataset"]).NAME
    except SpmlError as err:
        _blame(step, err, "dataset", mistakes)
        return None
    try:
        options, placement = step_objects(step)
        described = backbones.describe(options.backbone, options.weights, options.resolution, options.clip_features,
                                       options.crops, options.features)
    except SpmlError as err:
        _blame(step, err, "backbone" if "backbone" in step.given else None, mistakes)
        return None
    return output_path(placement.out, dataset, described.resolution, described.slug)
