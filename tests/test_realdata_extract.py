"""Stage one on real photos (realdata_support.py): 256 COCO photos, greyscale and odd sizes among them, through
EfficientNet-Lite0 with real ImageNet weights: every photo decoded, by both of the CPU's decoding paths, into
finite features made with timm's own preprocessing for the model."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image
from realdata_support import BACKBONE, FED_LIMIT, GREYSCALE, MODEL, NUM_CLASSES, SPLIT_ROWS, photos

from spml_cache import cache
from spml_cache.backbones.checkpoints import file_provenance

pytestmark = pytest.mark.realdata


def csv_rows() -> list[dict]:
    with open(photos() / "labels.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def label_matrix(rows: list[dict], classes: list[str]) -> np.ndarray:
    """The CSV's labels restated: a row's `|`-joined names as a 0/1 row over `classes`."""
    names = [set(filter(None, row["labels"].split("|"))) for row in rows]
    return np.array([[int(name in present) for name in classes] for present in names], dtype=np.uint8)


def timm_model(weights):
    import timm

    model = timm.create_model(MODEL, num_classes=0)
    model.load_state_dict(torch.load(weights, weights_only=True), strict=False)
    return model.eval()


def test_every_photo_is_decoded_into_finite_features_with_its_labels(realdata):
    loaded = cache.load(realdata.cache)
    rows = csv_rows()
    classes = sorted({name for row in rows for name in row["labels"].split("|") if name})
    assert loaded.classes == classes and len(classes) == NUM_CLASSES  # 76 of COCO's 80 occur here
    assert {name: len(getattr(loaded, name)) for name in cache.SPLITS} == SPLIT_ROWS
    assert json.loads(loaded.attrs["skipped_images"]) == {} and json.loads(loaded.attrs["skipped_missing"]) == []
    by_id = {row["path"]: row for row in rows}
    for name in cache.SPLITS:
        split = getattr(loaded, name)
        assert {by_id[i]["split"] for i in split.ids} == {"test" if name == "test" else "train"}
        np.testing.assert_array_equal(split.labels, label_matrix([by_id[i] for i in split.ids], classes))
        features = np.asarray(split.features)
        assert features.shape[1] == 1280 and np.isfinite(features).all()
        # No two photos give the same row: a photo decoded to blank or to another's pixels would.
        assert len(np.unique(features, axis=0)) == len(features)
    every = np.concatenate([np.asarray(getattr(loaded, name).features) for name in cache.SPLITS])
    # Real photos through real weights: rows of a similar size, none near zero. Measured: norms 9.4-21.1 (median
    # 15.5); a row under a tenth of the median would be an image that reached the trunk as nothing.
    norms = np.linalg.norm(every, axis=1)
    assert norms.min() > 0.1 * np.median(norms)
    ids = {i for name in cache.SPLITS for i in getattr(loaded, name).ids}
    assert set(GREYSCALE) <= ids and len(ids) == len(rows)


def test_the_cache_records_timms_preprocessing_and_the_weights_file(realdata):
    import timm

    attrs = cache.load(realdata.cache).attrs
    config = timm.data.resolve_data_config({}, model=timm.create_model(MODEL, pretrained=False))
    side = config["input_size"][-1]
    assert (attrs["backbone"], attrs["resolution"], attrs["feature_dim"]) == (BACKBONE, side, 1280)
    np.testing.assert_array_equal(attrs["mean"], config["mean"])  # 0.5 everywhere, not ImageNet's
    np.testing.assert_array_equal(attrs["std"], config["std"])
    shorter = int(side / config["crop_pct"])  # timm's eval transform: Resize(224 / 0.875 = 256), CenterCrop(224)
    interpolation = config["interpolation"]
    assert attrs["resize"] == f"shorter side {shorter}, {interpolation}, antialiased, centre crop {side}x{side}"
    assert attrs["weights"] == file_provenance(realdata.weights)
    assert attrs["decoder"] == "libjpeg-turbo"


def test_the_features_are_timms_own_evaluation_pipeline_on_the_photos(realdata):
    """timm's evaluation transform (PIL's resize and crop, then the model) on a few photos, among them both
    greyscale ones and the oddest sizes, gives the cached rows. Measured: relative L2 at most 3.5e-3 (PIL's
    bicubic resize is not torch's to the last level); 1e-2 allows for other CPUs, and is far below the distance
    between the rows of the two closest photos of the 256 (0.58)."""
    import timm

    loaded = cache.load(realdata.cache)
    model = timm_model(realdata.weights)
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    odd = ("images/val2017/000000001503.jpg", "images/val2017/000000002299.jpg", "images/train2017/000000000078.jpg",
           "images/train2017/000000000491.jpg")  # 320 x 240, 500 x 302, 612 x 612, 500 x 313
    rows = {}
    for name in cache.SPLITS:
        split = getattr(loaded, name)
        rows |= {i: split.features[k] for k, i in enumerate(split.ids) if i in GREYSCALE + odd}
    images = torch.stack([transform(Image.open(photos() / i).convert("RGB")) for i in rows])
    with torch.inference_mode():
        theirs = model(images).numpy()
    ours = np.stack(list(rows.values()))
    distance = np.linalg.norm(theirs - ours, axis=1) / np.linalg.norm(ours, axis=1)
    assert distance.max() < 1e-2, dict(zip(rows, distance))
    shifted = np.linalg.norm(theirs - np.roll(ours, 1, axis=0), axis=1) / np.linalg.norm(ours, axis=1)
    assert shifted.min() > 0.5  # each photo's features against another photo's row: the check can fail


def test_torchvisions_cpu_decoder_gives_pils_pixels_on_every_photo():
    """`--decode cpu` (torchvision's libjpeg-turbo) against the papers' PIL pipeline: `--help` promises a level;
    measured on these 256 photos, greyscale ones too: the same pixels, bit for bit."""
    from torchvision.io import ImageReadMode, decode_jpeg

    worst = {}
    for row in csv_rows():
        path = photos() / row["path"]
        ours = decode_jpeg(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), mode=ImageReadMode.RGB)
        theirs = torch.from_numpy(np.asarray(Image.open(path).convert("RGB"))).permute(2, 0, 1)
        assert ours.shape == theirs.shape, row["path"]
        worst[row["path"]] = int((ours.int() - theirs.int()).abs().max())
    assert max(worst.values()) <= 1, {k: v for k, v in worst.items() if v > 1}


def test_the_feed_threads_path_decodes_the_photos_as_the_loaders_does(realdata):
    """The path a GPU's extraction takes (file bytes from the loader, decoding in the feed thread, inputs padded
    to the batch size), forced on the CPU over the first photos of each split, against the loader's own decoding
    (the cache of every photo). Measured: the same rows to 1.0e-6 relative (the trunk's batches and threads differ);
    1e-5 is float32 rounding, far below what one level of one pixel moves."""
    fed, loader = cache.load(realdata.fed_cache), cache.load(realdata.cache)
    assert {name: len(getattr(fed, name)) for name in cache.SPLITS} == dict.fromkeys(cache.SPLITS, FED_LIMIT)
    assert json.loads(fed.attrs["skipped_images"]) == {}
    for name in cache.SPLITS:
        ours, theirs = getattr(fed, name), getattr(loader, name)
        expected = np.asarray(theirs.features)[[theirs.ids.index(i) for i in ours.ids]]
        distance = np.linalg.norm(np.asarray(ours.features) - expected, axis=1) / np.linalg.norm(expected, axis=1)
        assert distance.max() < 1e-5, (name, distance)


def test_random_weights_give_finite_features_of_every_photo(realdata):
    random = cache.load(realdata.random_cache)
    assert {name: len(getattr(random, name)) for name in cache.SPLITS} == SPLIT_ROWS
    assert json.loads(random.attrs["skipped_images"]) == {} and random.attrs["weights"] == "none"
    assert all(np.isfinite(np.asarray(getattr(random, name).features)).all() for name in cache.SPLITS)
