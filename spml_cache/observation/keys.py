"""The names results are kept under: a loss alone under the default rule, `loss@rule` under any other."""

from __future__ import annotations

DEFAULT_RULE = "single"
FLAG = "--observe"


def result_key(loss: str, rule) -> str:
    """The key of one result in a run directory: the loss's name under `single` (today's files), else
    `loss@rule` (`an@entry:0.1`); `rule` is a `Rule` or its text."""
    return loss if str(rule) == DEFAULT_RULE else f"{loss}@{rule}"


def split_key(key: str) -> tuple[str, str]:
    """(loss, rule text) of a result key."""
    loss, _, rule = key.partition("@")
    return loss, rule or DEFAULT_RULE
