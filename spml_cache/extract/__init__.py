"""Stage one: the frozen ResNet-50 over a dataset, once, into the HDF5 feature cache; or features computed
elsewhere (the authors' published files, or the clip-retrieval layout) into the same cache.

Its doors are `extract` (`spml-cache extract`) and `import_features` (`spml-cache import-features`).
"""

from spml_cache.extract.pipeline import PRECISIONS, ExtractReport, extract
from spml_cache.extract.imports import import_features
from spml_cache.extract.published import ImportReport

__all__ = ["PRECISIONS", "ExtractReport", "ImportReport", "extract", "import_features"]
