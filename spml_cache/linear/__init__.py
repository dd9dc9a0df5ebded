"""Stage two: linear heads on the cached features, every loss, the papers' grid, model selection.

Its door is `run_linear` (what `spml-cache linear` calls); `summary_table` prints a finished run's results.
"""

from spml_cache.linear.live import summary_table
from spml_cache.linear.run import LinearRun, LinearSettings, run_linear

__all__ = ["LinearRun", "LinearSettings", "run_linear", "summary_table"]
