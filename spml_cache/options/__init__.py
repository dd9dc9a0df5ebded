"""Every stage's options, each declared once (declared.py): what changes a run's results (`ExtractOptions`,
`LinearOptions`, `FinetuneOptions`) and where it runs (`ExtractPlacement`, `LinearPlacement`, `FinetunePlacement`).

A room of the core, so that the command line builds its commands from the declarations without importing a stage
(and torch): a stage imports its options from here.
"""

from spml_cache.options.declared import (
    Check, Option, Options, Placement, above, at_least, between, from_keywords, given, one_of, option, refuse_differences,
)
from spml_cache.options.keywords import from_flag_keywords
from spml_cache.options.extract import ExtractOptions, ExtractPlacement
from spml_cache.options.finetune import FinetuneOptions, FinetunePlacement
from spml_cache.options.linear import LinearOptions, LinearPlacement

__all__ = [
    "Check", "ExtractOptions", "ExtractPlacement", "FinetuneOptions", "FinetunePlacement", "LinearOptions", "LinearPlacement", "Option", "Options", "Placement", "above", "at_least", "between",
    "from_flag_keywords", "from_keywords", "given", "one_of", "option", "refuse_differences",
]
