"""`import-features`: the authors' published feature files (Cole et al., CVPR 2021) as a project cache.

Their layout, one folder per dataset:

    formatted_{train,val}_images.npy          image names, one per row
    formatted_{train,val}_labels.npy          full labels, 0/1, [N, C]
    formatted_{train,val}_labels_obs.npy      observed labels, -1/0/1 (their seed-1200 single positives)
    {train,val}_features_imagenet_resnet50.npy   pooled ResNet-50 features, [N, 2048]

Their `train` is the official training split and their `val` the official **test** split. We carve our val
split out of their train rows with `protocol.split_train_val` (the same draw their code makes) and keep their
observed labels, so the rows, labels and single positives equal theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from spml_cache import cache, datasets, protocol
from spml_cache.datasets import voc
from spml_cache.extract.pipeline import run_attrs
from spml_cache.cache.csr import DEFAULT_FORMAT, resolve_format
from spml_cache.extract.plan import estimated_size, refuse_foreign_file
from spml_cache.images import IMAGENET_MEAN, IMAGENET_STD
from spml_cache.runtime.disk import require_room
from spml_cache.runtime.errors import SpmlError, check_stop, unknown_name

FILES = {
    "images": "formatted_{split}_images.npy",
    "labels": "formatted_{split}_labels.npy",
    "observed": "formatted_{split}_labels_obs.npy",
    "features": "{split}_features_imagenet_resnet50.npy",
}
# Their image names are relative to their image folder; ours are relative to the dataset root.
ID_PREFIX = datasets.values_of("PUBLISHED_ID_PREFIX")
RESOLUTION = 448  # the authors' extraction: Resize((448, 448)) of a PIL image


@dataclass
class ImportReport:
    """What `import-features` wrote (`sc.import_features` returns it): `path`, the cache; `counts`, rows per split;
    `notes`, what was drawn or taken from where."""

    path: Path
    counts: dict[str, int]
    notes: list[str] = field(default_factory=list)


def _load(folder: Path, kind: str, split: str) -> np.ndarray:
    path = folder / FILES[kind].format(split=split)
    if kind == "observed" and not path.is_file():
        # generate_observed_labels.py of later versions names the file after its bias type.
        path = folder / f"formatted_{split}_uniform_labels_obs.npy"
    if not path.is_file():
        raise SpmlError(f"missing {folder / FILES[kind].format(split=split)}: expected the authors' {kind} file")
    check_stop()  # import_features takes a stop between its steps (`stops_deferred`)
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise SpmlError(f"{path} is not a readable .npy array of numbers or strings ({err})") from None


def _binary(array: np.ndarray, path_hint: str, allowed: tuple[int, ...]) -> np.ndarray:
    values = set(np.unique(array).tolist())
    if not values <= set(allowed):
        raise SpmlError(f"{path_hint}: values {sorted(values)[:5]} found; expected only {', '.join(map(str, allowed))}")
    return array.astype(np.int8)


def _read_split(folder: Path, split: str, with_observed: bool) -> dict:
    names = _load(folder, "images", split)
    labels = _load(folder, "labels", split)
    features = _load(folder, "features", split)
    arrays = {"images": names, "labels": labels, "features": features}
    if with_observed:
        arrays["observed"] = _load(folder, "observed", split)
    lengths = {kind: len(array) for kind, array in arrays.items()}
    if len(set(lengths.values())) != 1 or names.ndim != 1 or labels.ndim != 2 or features.ndim != 2:
        shapes = ", ".join(f"{kind} {array.shape}" for kind, array in arrays.items())
        raise SpmlError(f"{folder}: the {split} files disagree ({shapes}); they must have one row per image")
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes an inf, refused just below
        result = {
            "ids": [str(name) for name in names.tolist()],
            "labels": _binary(labels, str(folder / FILES["labels"].format(split=split)), (0, 1)).astype(np.uint8),
            "features": features.astype(np.float32),
        }
    wrong = cache.invalid_rows(result["features"])
    if len(wrong):
        raise SpmlError(
            f"{folder / FILES['features'].format(split=split)}: not finite (NaN or inf) in"
            f" {cache.describe_rows(wrong, result['ids'])}; nothing was written: fetch or export the published"
            " features again"
        )
    if with_observed:
        observed = _binary(arrays["observed"], str(folder / FILES["observed"].format(split=split)), (-1, 0, 1))
        if observed.shape != labels.shape or ((observed == 1) & (result["labels"] == 0)).any():
            raise SpmlError(
                f"{folder}: the {split} observed labels do not fit the full labels (shape, or a positive that is"
                " not a true label); the two files must come from the same formatting run"
            )
        result["observed"] = observed
    return result


def _classes(dataset: str, num_classes: int, classes_file: Path | None) -> tuple[list[str], list[str]]:
    if classes_file is not None:
        names = [line.strip() for line in Path(classes_file).read_text().splitlines() if line.strip()]
        if len(names) != num_classes:
            raise SpmlError(f"--classes {classes_file}: {len(names)} names for {num_classes} label columns")
        return names, []
    if dataset == "voc" and num_classes == len(voc.CLASSES):
        return list(voc.CLASSES), []
    note = f"class names are not in the authors' files: named class_0 .. class_{num_classes - 1} (pass --classes FILE)"
    return [f"class_{i}" for i in range(num_classes)], [note]


def write_import(path: Path, attrs: dict, splits: dict[str, dict]) -> Path:
    """The imported cache written at `path` once the disk has room for it (`cache.write`: a full disk met anyway,
    or a stop, leaves no partial file)."""
    rows = {name: cache.SplitRows(split["ids"], split["labels"], split.get("observed"), split.get("label_mask"))
            for name, split in splits.items()}
    num_classes = int(attrs["num_classes"])
    width = int(np.shape(splits["train"]["features"])[1])
    require_room(path, estimated_size(rows, num_classes, width, resolve_format(DEFAULT_FORMAT, num_classes)))
    return cache.write(path, attrs=attrs, **splits)


def import_published(
    folder: Path, *, dataset: str, out: Path | None = None, classes_file: Path | None = None, force: bool = False
) -> ImportReport:
    """Write the cache of `dataset` from the authors' files in `folder`; refuses to replace a cache unless `force`."""
    folder = Path(folder).expanduser()
    if dataset not in ID_PREFIX:
        raise SpmlError(f"--dataset {dataset}: {unknown_name('dataset', dataset, ID_PREFIX)}; choose one of"
                        f" {', '.join(ID_PREFIX)}")
    if not folder.is_dir():
        raise SpmlError(f"{folder} is not a folder; pass the folder that holds the authors' formatted_*.npy files")
    path = cache.default_path(dataset, RESOLUTION) if out is None else Path(out).expanduser()
    refuse_foreign_file(path)
    if path.exists() and not force:
        raise SpmlError(f"{path} already exists: pass --force to replace it, or pick another --out")
    train = _read_split(folder, "train", with_observed=True)
    test = _read_split(folder, "val", with_observed=False)
    if train["labels"].shape[1] != test["labels"].shape[1] or train["features"].shape[1] != test["features"].shape[1]:
        raise SpmlError(f"{folder}: train and val files have different numbers of classes or feature widths")
    classes, notes = _classes(dataset, train["labels"].shape[1], classes_file)
    for split in (train, test):
        split["ids"] = [ID_PREFIX[dataset] + image_id for image_id in split["ids"]]
    train_rows, val_rows = protocol.split_train_val(
        len(train["ids"]), val_frac=protocol.VAL_FRAC, seed=protocol.SPLIT_SEED
    )

    def rows_of(indices: np.ndarray) -> dict:
        return {
            "features": train["features"][indices],
            "labels": train["labels"][indices],
            "ids": [train["ids"][i] for i in indices],
            "observed": train["observed"][indices],
        }

    observed = train["observed"]
    attrs = {
        "dataset": dataset,
        "classes": json.dumps(classes),
        "num_classes": len(classes),
        "backbone": "resnet50",
        "weights": "IMAGENET1K_V1",  # torchvision's pretrained=True when the authors extracted
        "resolution": RESOLUTION,
        "resize": f"{RESOLUTION}x{RESOLUTION}, bilinear (PIL), no crop",
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
        "feature_dim": int(train["features"].shape[1]),
        "precision": "fp32",
        "limit": 0,
        "split_seed": protocol.SPLIT_SEED,
        "val_frac": protocol.VAL_FRAC,
        "observe_seed": protocol.OBSERVE_SEED,  # the authors' default; their files do not record it
        "num_pos": int((observed == 1).sum(axis=1).max(initial=0)),
        "num_neg": int((observed == -1).sum(axis=1).max(initial=0)),
        "expected_positives": float(protocol.expected_positives(train["labels"])),
        "skipped_missing": "[]",
        "skipped_images": "{}",
        "source": f"import-features {folder.resolve()}",
        **run_attrs(torch.device("cpu")),
        "device": "unknown (the authors' features)",
    }
    test_split = {"features": test["features"], "labels": test["labels"], "ids": test["ids"]}
    written = write_import(path, attrs, {"train": rows_of(train_rows), "val": rows_of(val_rows), "test": test_split})
    counts = {"train": len(train_rows), "val": len(val_rows), "test": len(test["ids"])}
    return ImportReport(written, counts, notes)

