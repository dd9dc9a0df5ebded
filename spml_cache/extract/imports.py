"""`import-features`: embeddings computed elsewhere into a project cache, from either layout it reads: the
clip-retrieval layout (an img_emb/ folder: embeddings.py; an `spml-cache export` read back as it was, or other
tools' output matched to a dataset read under `root`) or the authors' published files (published.py)."""

from __future__ import annotations

from pathlib import Path

from spml_cache.cache.embeddings import SIDECAR, is_export, is_layout, read_sidecar
from spml_cache.extract.embeddings import import_embeddings, import_export
from spml_cache.extract.published import ImportReport, import_published
from spml_cache.options.extract import ImportOptions
from spml_cache.options.keywords import default_data_root
from spml_cache.runtime.errors import Interrupted, SpmlError, finished, stops_deferred


def run_import(options: ImportOptions) -> ImportReport:
    """`spml-cache import-features`'s door: `import_features` with the options declared for it (options/extract.py,
    each flag's help); `root` not given: $SPML_DATA."""
    return import_features(options.folder, dataset=options.dataset, root=options.root or default_data_root(),
                           out=options.out, classes_file=options.classes, force=options.force)


def import_features(folder: Path, *, dataset: str | None = None, root: Path | None = None, out: Path | None = None,
                    classes_file: Path | None = None, force: bool = False) -> ImportReport:
    """Write the cache of `dataset` from the files in `folder` (`dataset` may be left out for an `spml-cache
    export`, which names its own); refuses to replace a cache unless `force`. Ctrl-C and SIGTERM are taken at
    safe points (a KeyboardInterrupt raised inside one of h5py's callbacks is printed and lost), and leave
    nothing written."""
    try:
        with stops_deferred():
            report = _import(Path(folder).expanduser(), dataset=dataset, root=root, out=out,
                             classes_file=classes_file, force=force)
            finished()  # the cache is sealed: a stop that came meanwhile has nothing left to stop
            return report
    except KeyboardInterrupt:  # cache.write has removed its partial file
        raise Interrupted("nothing was written") from None


def _import(folder: Path, *, dataset: str | None, root: Path | None, out: Path | None, classes_file: Path | None,
            force: bool) -> ImportReport:
    if not is_layout(folder):
        if dataset is None:
            raise SpmlError(f"{folder}: say which dataset these features are of with --dataset NAME")
        return import_published(folder, dataset=dataset, out=out, classes_file=classes_file, force=force)
    sidecar = read_sidecar(folder)
    recorded = sidecar.get("dataset")
    if recorded and dataset not in (None, recorded):
        raise SpmlError(f"--dataset {dataset}: {folder / SIDECAR} says this export is of {recorded}; pass --dataset"
                        f" {recorded}, or leave --dataset out")
    if classes_file is not None:
        raise SpmlError(f"--classes {classes_file}: the clip-retrieval layout takes the class names from the"
                        f" {'export' if recorded else 'dataset under --root'}; leave --classes out")
    if is_export(sidecar):  # made by `spml-cache export`: read back as it was, no images needed
        return import_export(folder, out=out, force=force)
    dataset = dataset or recorded
    if dataset is None:
        raise SpmlError(f"{folder}: say which dataset these embeddings are of with --dataset NAME (its images are"
                        " read under --root)")
    if root is None:
        raise SpmlError(f"{folder} holds embeddings in the clip-retrieval layout: pass --root DIR, the dataset's"
                        " folder (its images are matched to the embedding rows)"
                        + ("; or export the cache again: an export now records its splits and needs no --root"
                           if recorded else ""))
    return import_embeddings(folder, dataset=dataset, root=root, out=out, force=force)
