"""Stage one: a frozen backbone (any of backbones/, ResNet-50 by default) over a dataset, once, into the HDF5 feature
cache; or features computed elsewhere (the authors' published files, or the clip-retrieval layout) into the same
cache.

Its doors are `run_extract(ExtractOptions, ExtractPlacement) -> ExtractReport` (`spml-cache extract`;
`extract(dataset, root, **keywords)` is its keyword form) and `run_import(ImportOptions)` (`spml-cache import-features`; `import_features(folder, **keywords)` its keyword form).
`sc.extract(...)` (face.py: keywords named as the flags; `sc.import_features` beside it) is this package called.
"""

from spml_cache.extract.batches import PRECISIONS
from spml_cache.extract.pipeline import ExtractReport, extract, run_extract
from spml_cache.extract.imports import import_features, run_import
from spml_cache.extract.published import ImportReport
from spml_cache.options import ExtractOptions, ExtractPlacement
from spml_cache.extract.face import extract as face_door
from spml_cache.options.keywords import callable_stage

__all__ = [
    "PRECISIONS", "ExtractOptions", "ExtractPlacement", "ExtractReport", "ImportReport", "extract", "import_features",
    "run_extract", "run_import",
]

callable_stage(__name__, face_door)
