"""The cache's schema (docs/internals.md, "cache"): its constants, what a split holds, where files live, its id.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import numpy as np

from spml_cache.runtime.errors import SpmlError, check_stop

SCHEMA_VERSION = 1
SPLITS = ("train", "val", "test")
OBSERVED_SPLITS = ("train", "val")
# /{train,val}/observed_rules/<rule text>: int8 [N, C] masks of observation rules besides `single` (`observed`),
# written only with `extract --observe`; a cache without the group reads as one without extra rules.
RULES_GROUP = "observed_rules"
# /{split}/label_mask: uint8 [N, C], 1 where the label is annotated, written only for partially labelled data (a
# dataset whose own labels have unknown entries); a cache without it has every label annotated.
MASK = "label_mask"
COPY_BLOCK_ROWS = 8192


@dataclass(frozen=True)
class SplitRows:
    """Everything of one split but the features: what a cache is built for, and what resuming must match."""

    ids: list[str]
    labels: np.ndarray  # uint8 [N, C], or a sparse.SparseLabels
    observed: np.ndarray | None  # int8 [N, C] (or SparseLabels) for train and val, None for test
    label_mask: np.ndarray | None = None  # uint8 [N, C] (or SparseLabels), 1 where annotated; None: all annotated

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class CachedSplit:
    """One split of a cache: `features` [N, D], `labels` (the full ground truth), `ids` (each image's path under the
    dataset's root), `observed` (train and val: 1 the observed positive, 0 unobserved, -1 an observed negative),
    the other observation rules' masks (`rules`), the partial labels' `label_mask`, a CLIP cache's embeddings."""

    features: np.ndarray  # float32 [N, D]; a StoredFeatures (rows read on demand) when loaded out of core
    labels: np.ndarray  # uint8 [N, C], or a sparse.SparseLabels (int8) where the cache stores it sparse
    ids: list[str]
    observed: np.ndarray | None  # int8 [N, C] or SparseLabels (train, val); None for test
    _: KW_ONLY
    rules: dict[str, np.ndarray] = field(default_factory=dict)  # {rule text: int8 [N, C]}, stored other rules
    label_mask: np.ndarray | None = None  # uint8 [N, C], 1 where the label is annotated; None: all of them are
    # A CLIP cache's image side (docs/internals.md, "The text side"): L2-normalised embeddings, None when absent.
    image_embeddings: np.ndarray | None = None  # float32 [N, E]
    crop_embeddings: np.ndarray | None = None  # float32 [N, G*G, E]: a G x G grid of crops (`extract --crops G`)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, kw_only=True)
class FeatureSet:
    """A cache as `load` (`sc.load_cache`) reads it: its `train`, `val` and `test` splits (`CachedSplit`), the
    `classes`' names, its `attrs` (how it was made: backbone, weights, resolution, protocol seeds, ...), `dataset`,
    `path`, and a CLIP cache's class `text_embeddings`."""

    train: CachedSplit
    val: CachedSplit
    test: CachedSplit
    classes: list[str]
    attrs: dict
    dataset: str
    path: Path
    text_embeddings: np.ndarray | None = None  # float32 [C, E], L2-normalised class prompts; None: no text side

    @property
    def has_text_side(self) -> bool:
        """Whether the cache holds class text embeddings and every split's image embeddings."""
        return self.text_embeddings is not None

    def similarity(self, split: str) -> np.ndarray:
        """float32 [N, C]: cosine similarity of each image embedding of `split` with each class's text embedding
        (both are stored L2-normalised). Only on a cache with a text side (`has_text_side`)."""
        return _cosine(getattr(self, split).image_embeddings, self.text_embeddings)

    def require_text_side(self, names: list[str]) -> None:
        """One line naming the cache and the fix where losses that read the text side (`names`) meet a cache
        without one."""
        if names and not self.has_text_side:
            named = ", ".join(names)
            raise SpmlError(f"{self.path} has no text side (class text embeddings), which --loss {named} needs:"
                            f" extract the cache from a CLIP backbone (spml-cache extract {self.dataset} --backbone"
                            f" clip:ViT-B-16/openai), or leave {named} out of --loss")

    def train_similarities(self) -> dict[str, np.ndarray | None]:
        """What a loss that reads the text side is built with: `train_similarity` [N_train, C] and
        `train_crop_similarity` [N_train, G*G, C] (None where the cache lacks them)."""
        if not self.has_text_side:
            return {"train_similarity": None, "train_crop_similarity": None}
        return {"train_similarity": self.similarity("train"), "train_crop_similarity": self.crop_similarity("train")}

    def crop_similarity(self, split: str) -> np.ndarray | None:
        """float32 [N, G*G, C]: the same for each crop of the grid of `split`'s images; None when the cache stores
        no crops."""
        crops = getattr(self, split).crop_embeddings
        return None if crops is None or self.text_embeddings is None else _cosine(crops, self.text_embeddings)


def _cosine(embeddings: np.ndarray | None, text: np.ndarray | None) -> np.ndarray:
    if embeddings is None or text is None:
        raise SpmlError("this cache has no text side (image and class text embeddings): extract it with"
                        " --backbone clip:ViT-B-16/openai")
    return np.matmul(embeddings, text.T, dtype=np.float32)


def default_cache_dir() -> Path:
    """`$SPML_CACHE`, else `./cache`: where caches are written and looked for."""
    return Path(os.environ.get("SPML_CACHE") or "cache")


def default_path(
    dataset: str, resolution: int = 448, folder: Path | str | None = None, backbone: str = "resnet50"
) -> Path:
    """`<folder or $SPML_CACHE or ./cache>/<dataset>-<backbone>-<resolution>.h5`."""
    folder = Path(folder) if folder is not None else default_cache_dir()
    return folder / f"{dataset}-{backbone}-{resolution}.h5"


def find_cache(cache: Path | str | None, dataset: str | None, folder: Path | str | None = None) -> Path:
    """`--cache PATH`, or the one cache of `--dataset NAME` in `folder` (default `default_cache_dir()`)."""
    if cache is not None and dataset is not None:
        raise SpmlError("pass either --cache PATH or --dataset NAME, not both")
    if cache is not None:
        return Path(cache)
    if dataset is None:
        raise SpmlError("say which features to train on: --cache PATH or --dataset NAME")
    folder = Path(folder) if folder is not None else default_cache_dir()
    found = caches_of(dataset, folder)
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(p.name for p in found)
        raise SpmlError(f"several caches for '{dataset}' in {folder}/ ({names}): pick one with --cache PATH")
    partial = sorted(p.name for p in folder.glob(f"{dataset}-*.h5.partial"))
    if partial:
        raise SpmlError(f"{folder / partial[0]} is an unfinished extraction: resume it with "
                        f"`spml-cache extract {dataset} --root DIR`")
    raise SpmlError(f"no cache for dataset '{dataset}' in {folder}/ (set SPML_CACHE or pass --cache PATH); "
                    f"create one with `spml-cache extract {dataset} --root DIR`")


def caches_of(dataset: str, folder: Path) -> list[Path]:
    """The caches of `dataset` in `folder`: every `<dataset>-*.h5` (the names extract and import-features give), and
    any other `.h5` whose attrs name the dataset (`import-features --out cache/voc-imported.h5`, a cache renamed),
    so that --dataset never takes one of them while another sits beside it unseen."""
    import h5py

    found = []
    for path in sorted(folder.glob("*.h5")):
        if path.name.startswith(f"{dataset}-"):
            found.append(path)
            continue
        try:
            with h5py.File(path, "r") as file:
                named = file.attrs.get("dataset")
        except OSError:  # not an HDF5 file (or not readable): no cache of anything, left to --cache
            continue
        if plain(named) == dataset:
            found.append(path)
    return found


def partial_path(path: Path | str) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".partial")


def plain(value):
    """An HDF5 attribute value as plain Python (numpy scalars and arrays become ints, floats, lists)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


CONTENT_ATTR = "content_hash"  # the checksum of a cache's arrays, written when it is sealed


def content_hash(splits: dict, text=None) -> str:
    """A checksum of a cache's arrays: per split (in SPLITS order) its features, labels, observed labels and ids.
    `splits` maps a split to `(features, labels, observed or None, ids[, label mask or None[, {name: embeddings}]])`
    and `text` is a CLIP cache's class text embeddings; features and embeddings may be h5py datasets (read in
    blocks) or arrays: the same bytes hash the same either way. A cache without a mask or a text side hashes as
    before they existed."""
    digest = hashlib.blake2b(digest_size=16)
    for name in SPLITS:
        features, labels, observed, ids, *rest = splits[name]
        _digest_rows(digest, features)
        _digest_labels(digest, labels, np.uint8)
        if observed is not None:
            _digest_labels(digest, observed, np.int8)
        digest.update("\n".join(ids).encode("utf-8"))
        if rest and rest[0] is not None:
            digest.update(b"label_mask")
            _digest_labels(digest, rest[0], np.uint8)
        for key, embeddings in (rest[1] if len(rest) > 1 else {}).items():
            if embeddings is not None:
                digest.update(key.encode("utf-8"))
                _digest_rows(digest, embeddings)
    if text is not None:
        digest.update(b"text")
        _digest_rows(digest, text)
    return digest.hexdigest()


def _digest_rows(digest, rows) -> None:
    """A row array's float32 bytes, a block of rows at a time (an h5py dataset is never read whole)."""
    for start in range(0, len(rows), COPY_BLOCK_ROWS):
        check_stop()  # sealing a large cache reads all of it: a stop asked for meanwhile is taken here
        digest.update(np.ascontiguousarray(rows[start : start + COPY_BLOCK_ROWS], dtype="<f4").data)


def _digest_labels(digest, labels, dtype) -> None:
    """A dense matrix's bytes; a sparse one's CSR arrays (dense caches hash as they always did)."""
    if hasattr(labels, "indptr"):
        for part in (labels.indptr, labels.indices, labels.values):
            digest.update(np.ascontiguousarray(part).data)
    else:
        digest.update(np.ascontiguousarray(labels, dtype=dtype).data)


def cache_id(attrs: dict) -> str:
    """Short stable id of one cache: a hash of all its attrs (`created` and the content checksum included, so
    rebuilds and other contents differ)."""
    text = json.dumps({key: plain(value) for key, value in attrs.items()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
