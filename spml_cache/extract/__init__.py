"""Stage one: the frozen ResNet-50 over a dataset, once, into the HDF5 feature cache; or the authors' published
features into the same cache.

Its doors are `extract` (`spml-cache extract`) and `import_features` (`spml-cache import-features`).
"""

from spml_cache.extract.pipeline import PRECISIONS, ExtractReport, extract
from spml_cache.extract.published import ImportReport, import_features

__all__ = ["PRECISIONS", "ExtractReport", "ImportReport", "extract", "import_features"]
