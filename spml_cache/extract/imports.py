"""`import-features`: embeddings computed elsewhere into a project cache, from either layout it reads: the
clip-retrieval layout (an img_emb/ folder: embeddings.py, matched to a dataset read under `root`) or the
authors' published files (published.py)."""

from __future__ import annotations

from pathlib import Path

from spml_cache.cache.embeddings import is_layout
from spml_cache.extract.embeddings import import_embeddings
from spml_cache.extract.published import ImportReport, import_published
from spml_cache.runtime.errors import Interrupted, SpmlError, finished, stops_deferred


def import_features(folder: Path, *, dataset: str, root: Path | None = None, out: Path | None = None,
                    classes_file: Path | None = None, force: bool = False) -> ImportReport:
    """Write the cache of `dataset` from the files in `folder`; refuses to replace a cache unless `force`. Ctrl-C
    and SIGTERM are taken at safe points (a KeyboardInterrupt raised inside one of h5py's callbacks is printed
    and lost), and leave nothing written."""
    try:
        with stops_deferred():
            report = _import(folder, dataset=dataset, root=root, out=out, classes_file=classes_file, force=force)
            finished()  # the cache is sealed: a stop that came meanwhile has nothing left to stop
            return report
    except KeyboardInterrupt:  # cache.write has removed its partial file
        raise Interrupted("nothing was written") from None


def _import(folder: Path, *, dataset: str, root: Path | None, out: Path | None, classes_file: Path | None,
            force: bool) -> ImportReport:
    if not is_layout(Path(folder).expanduser()):
        return import_published(folder, dataset=dataset, out=out, classes_file=classes_file, force=force)
    if root is None:
        raise SpmlError(f"{folder} holds embeddings in the clip-retrieval layout: pass --root DIR, the dataset's"
                        " folder (its images are matched to the embedding rows)")
    if classes_file is not None:
        raise SpmlError(f"--classes {classes_file}: the clip-retrieval layout takes the class names from the"
                        " dataset under --root; leave --classes out")
    return import_embeddings(folder, dataset=dataset, root=root, out=out, force=force)
