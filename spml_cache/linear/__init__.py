"""Stage two: linear heads on the cached features, every loss, the papers' grid, model selection.

Its door is `run_linear(LinearOptions, LinearPlacement) -> LinearRun` (what `spml-cache linear` calls; the Python
API may give both types' fields as keywords instead); `summary_table` prints a finished run's results,
`summary_notes` the lines under it.
`sc.linear(...)` (face.py: keywords named as the flags) is this package called.
"""

from spml_cache.linear.live import summary_notes, summary_table
from spml_cache.linear.run import LinearRun, LinearSettings, run_linear
from spml_cache.options import LinearOptions, LinearPlacement
from spml_cache.linear.face import linear as face_door
from spml_cache.options.keywords import callable_stage

__all__ = ["LinearOptions", "LinearPlacement", "LinearRun", "LinearSettings", "run_linear", "summary_notes",
           "summary_table"]

callable_stage(__name__, face_door)
