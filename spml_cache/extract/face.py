"""`sc.extract(...)` and `sc.import_features(...)`: stage one from Python, their keywords named as `spml-cache
extract`'s and `import-features`' flags and read and checked by their declarations (options/keywords.py); quiet
unless `progress=True`."""

from __future__ import annotations

from dataclasses import replace

from spml_cache.extract.imports import run_import
from spml_cache.extract.pipeline import ExtractReport, run_extract
from spml_cache.extract.published import ImportReport
from spml_cache.options import ExtractOptions, ExtractPlacement
from spml_cache.options.extract import ImportOptions
from spml_cache.options.keywords import default_data_root, documented, from_flag_keywords, no_positional
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.progress import door_console, reporting_to


def extract(dataset=None, *args, progress: bool = False, **keywords) -> ExtractReport:
    """Stage one, `spml-cache extract` from Python: run a frozen backbone over the dataset under `root` (default:
    $SPML_DATA) once and write its features to the HDF5 cache (an interrupted run resumes; a complete cache with
    these settings is not recomputed unless `force=True`).

    Returns the `ExtractReport`: `path` (the cache: `sc.load_cache(report.path)` reads it), `status` (written, up
    to date or dry run), `counts` (rows per split), and what was left out. Under torchrun the other processes
    get None."""
    no_positional("sc.extract", args, progress)
    given = {"dataset": dataset, **keywords} if dataset is not None else keywords
    options, placement = from_flag_keywords("sc.extract", given, ExtractOptions, ExtractPlacement,
                                            also=["progress"])
    placement = replace(placement, root=placement.root or default_data_root())
    if placement.root is None:
        raise SpmlError("sc.extract: no data root: give root=DIR (the dataset's folder) or set SPML_DATA")
    with reporting_to(door_console(progress)):
        return run_extract(options, placement)


def import_features(folder=None, *args, progress: bool = False, **keywords) -> ImportReport:
    """`spml-cache import-features` from Python: features computed elsewhere (the authors' published files, or
    embeddings in the clip-retrieval layout, an `spml-cache export` among them) into a project cache.

    Returns the `ImportReport`: `path` (the cache), `counts` (rows per split), `notes`."""
    no_positional("sc.import_features", args, progress)
    given = {"folder": folder, **keywords} if folder is not None else keywords
    (options,) = from_flag_keywords("sc.import_features", given, ImportOptions, also=["progress"])
    with reporting_to(door_console(progress)):
        return run_import(options)


documented(extract, ExtractOptions, ExtractPlacement, positional=["dataset"])
documented(import_features, ImportOptions, positional=["folder"])
