"""Stage two: linear heads on the cached features, every loss, the papers' grid, model selection.

Its door is `run_linear_options` (what `spml-cache linear` calls, with a `LinearOptions` and a `LinearPlacement`),
and `run_linear` the same by keywords; `summary_table` prints a finished run's results.
"""

from spml_cache.linear.live import summary_table
from spml_cache.linear.options import LinearOptions, LinearPlacement
from spml_cache.linear.run import LinearRun, LinearSettings, run_linear, run_linear_options

__all__ = ["LinearOptions", "LinearPlacement", "LinearRun", "LinearSettings", "run_linear", "run_linear_options",
           "summary_table"]
