"""Observation rules (docs/protocol.md, "Observation rules"): which of the full labels a learner is shown.

`rules.py`: a rule's contract, the registry and `--observe`'s parser (`Rule`, `parse_rules`); `draws.py`: the
rules, one class each with its dense and its sparse draw; `rows.py`: a cache's rows under a rule (`draw_splits`,
`for_cache`, `Observed`); `keys.py`: the names results are kept under (`result_key`, `split_key`).
"""

from spml_cache.observation import draws  # noqa: F401  (imported for registration: fills RULES)
from spml_cache.observation.keys import DEFAULT_RULE, FLAG, result_key, split_key
from spml_cache.observation.rows import (
    Observed,
    draw_splits,
    drawn_note,
    for_cache,
    official_positions,
    refuse_unobserved,
    with_rule,
    without_positive,
)
from spml_cache.observation.rules import (
    MAX_SEED,
    RULES,
    SEED,
    Areas,
    ObservationRule,
    Param,
    Rule,
    keeping_a_positive,
    parse_rule,
    parse_rules,
    register,
)

__all__ = [
    "DEFAULT_RULE", "FLAG", "MAX_SEED", "RULES", "SEED", "Areas", "ObservationRule", "Observed", "Param", "Rule", "draw_splits",
    "drawn_note", "for_cache", "keeping_a_positive", "official_positions", "parse_rule", "refuse_unobserved", "parse_rules", "register", "result_key",
    "split_key", "with_rule", "without_positive",
]
