"""`spml-cache extract --backbone ...` from a subprocess, one family each: the cache's name, its settings attrs
(backbone, weights, the backbone's own preprocessing, width), and for CLIP the image embeddings of every split
and the class prompts' text embeddings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest
from backbone_support import TINY_CLIP, register_tiny_clip, tiny_clip_config
from cli_support import REPO, run_cli
from extract_support import write_numbered_csv_dataset

from spml_cache import cache
from spml_cache.extract import extract
from spml_cache.runtime.errors import SpmlError

# The command line, with an open_clip model config registered first (the tiny CLIP exists only in the tests).
LAUNCHER = """import runpy, sys
import open_clip
open_clip.add_model_config(sys.argv.pop(1))
sys.argv[0] = "spml-cache"
runpy.run_module("spml_cache", run_name="__main__")
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("backbones")
    return write_numbered_csv_dataset(folder, 14, first_test=10, classes=("cat", "potted_plant"))


def run(folder, *args: str, clip: bool = False) -> subprocess.CompletedProcess:
    """`spml-cache extract csv ... ARGS` (through the launcher when the tiny CLIP is needed)."""
    (folder / "launch.py").write_text(LAUNCHER)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), SPML_OFFLINE="1", COLUMNS="400", SPML_CACHE=str(folder / "cache"))
    start = [str(folder / "launch.py"), str(tiny_clip_config(folder))] if clip else ["-m", "spml_cache"]
    command = [sys.executable, *start, "extract", "csv", "--root", str(folder), "--weights", "none", "--device",
               "cpu", "--workers", "0", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.filterwarnings("ignore::spml_cache.backbones.checkpoints.RandomWeightsWarning")
def test_timm_and_torchvision_backbones_write_their_own_caches(data):
    done = run(data, "--backbone", "timm:resnet10t", "--resolution", "32")
    assert done.returncode == 0, done.stderr
    # torchvision's family in this process (a subprocess costs seconds of imports; the CLI path is the same)
    extract("csv", data, backbone="resnet18", weights="none", resolution=32, device="cpu", workers=0,
            out=data / "cache")
    names = sorted(p.name for p in (data / "cache").glob("*.h5"))
    assert names == ["csv-resnet18-32.h5", "csv-timm_resnet10t-32.h5"]
    timm_cache = cache.load(data / "cache" / "csv-timm_resnet10t-32.h5")
    attrs = timm_cache.attrs
    assert (attrs["backbone"], attrs["weights"], attrs["feature_dim"]) == ("timm:resnet10t", "none", 512)
    assert attrs["resize"] == "shorter side 37, bicubic, antialiased, centre crop 32x32"
    assert "clip_features" not in attrs and "timm_version" in attrs
    assert timm_cache.train.features.shape[1] == 512
    with h5py.File(data / "cache" / "csv-resnet18-32.h5") as file:
        assert file["test"]["features"].shape == (4, 512) and "text" not in file
        assert list(file["train"]) == ["done", "features", "ids", "labels", "observed"]


# The hub unreachable (a closed local port), its backoff's waits (1 + 2 + 4 + 8 + 8 s per file tried) made instant.
UNREACHABLE_HUB = """import runpy, sys
import huggingface_hub.utils._http as http
http.time.sleep = lambda seconds: None
sys.argv[0] = "spml-cache"
runpy.run_module("spml_cache", run_name="__main__")
"""


def test_timm_weights_from_an_unreachable_hub_are_one_line_naming_spml_offline(data, tmp_path):
    """Without SPML_OFFLINE, timm asks the hub, which retries each file five times and logs every try; what the
    user sees is the one line, saying how long it tried and that SPML_OFFLINE=1 stops at once."""
    (tmp_path / "launch.py").write_text(UNREACHABLE_HUB)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SPML_", "HF_"))}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400", SPML_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"),
               HF_ENDPOINT="http://127.0.0.1:9")
    done = subprocess.run([sys.executable, str(tmp_path / "launch.py"), "extract", "csv", "--root", str(data),
                           "--backbone", "timm:resnet10t", "--resolution", "32", "--device", "cpu", "--workers", "0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: timm:resnet10t: its pretrained weights") and "Retrying" not in done.stdout
    assert re.search(r"could not be fetched after \d+ s of the hub's retries \(SPML_OFFLINE=1 stops at once\)", line)
    assert "--weights none" in line


def test_clip_backbone_writes_image_and_text_embeddings(data, tmp_path):
    (tmp_path / "prompts.txt").write_text("a photo of a {}.\na {} in the wild.\n")
    done = run(data, "--backbone", f"clip:{TINY_CLIP}", "--clip-features", "pre", "--prompts",
               str(tmp_path / "prompts.txt"), "--batch-size", "4", "--crops", "2", clip=True)
    assert done.returncode == 0, done.stderr
    path = data / "cache" / f"csv-clip_{TINY_CLIP.replace('-', '_')}-32.h5"
    with h5py.File(path) as file:
        attrs = {key: cache.plain(value) for key, value in file.attrs.items()}
        assert (attrs["backbone"], attrs["clip_features"], attrs["feature_dim"]) == (f"clip:{TINY_CLIP}", "pre", 32)
        assert json.loads(attrs["templates"]) == ["a photo of a {}.", "a {} in the wild."] and attrs["grid"] == 2
        assert attrs["resolution"] == 32
        for split in cache.SPLITS:
            group = file[split]
            embeddings = group["image_embeddings"][...]
            assert group["features"].shape == (len(group["ids"]), 32) and embeddings.shape == (len(group["ids"]), 16)
            assert embeddings.dtype == np.float32
            np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
            crops = group["crop_embeddings"][...]
            assert crops.shape == (len(group["ids"]), 4, 16) and group["crop_embeddings"].attrs["grid"] == 2
            np.testing.assert_allclose(np.linalg.norm(crops, axis=2), 1.0, rtol=1e-5)
        text = file["text"]["embeddings"]
        assert text.shape == (2, 16) and json.loads(text.attrs["templates"]) == json.loads(attrs["templates"])
        np.testing.assert_allclose(np.linalg.norm(text[...], axis=1), 1.0, rtol=1e-5)
    features = cache.load(path)  # stage two reads what stage one wrote: the text side, and the losses that use it
    assert features.has_text_side and features.similarity("train").shape == (len(features.train), 2)
    assert features.train.crop_embeddings.shape[1:] == (4, 16)
    cache.verify(features)  # the checksum covers the text side: swapping two classes' prompts is seen
    tampered = tmp_path / "tampered.h5"
    tampered.write_bytes(path.read_bytes())
    with h5py.File(tampered, "r+") as file:
        file["text"]["embeddings"][...] = file["text"]["embeddings"][...][::-1]
    with pytest.raises(SpmlError, match="was changed after it was written"):
        cache.verify(cache.load(tampered))
    done = run_cli("linear", "--cache", str(path), "--loss", "vlpl,gpr", "--lr", "1e-2", "--batch-size", "4",
                   "--epochs", "1", "--out", str(tmp_path / "runs"), "--device", "cpu", "--workers", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    results = json.loads(next((tmp_path / "runs").rglob("results.json")).read_text())
    assert {"vlpl", "gpr"} <= set(results["losses"]) and "zero_shot" in results["reference"]
    register_tiny_clip(tmp_path)  # in this process too
    with pytest.raises(SpmlError, match="templates: .* --force"):  # other templates, another cache
        extract("csv", data, out=path, backbone=f"clip:{TINY_CLIP}", weights="none", clip_features="pre", crops=2,
                device="cpu", workers=0)


def test_partial_caches_carry_embeddings_and_text_through_shards_and_dropped_rows(tmp_path):
    """Rank 0's join of two shards, then finalising with a bad row (the compact copy): every per-row dataset
    and the text group come through, rows in place."""
    shapes = {"features": (3,), "image_embeddings": (2,)}
    ids = [f"{k}.jpg" for k in range(5)]
    labels = np.eye(2, dtype=np.uint8)[[0, 1, 0, 1, 0]]
    rows = {name: cache.SplitRows(ids, labels, None if name == "test" else np.zeros_like(labels, dtype=np.int8))
            for name in cache.SPLITS}
    attrs = {"num_classes": 2, "dataset": "csv"}
    text = {"embeddings": np.ones((2, 2), dtype=np.float32), "templates": ["{}"]}
    wide = np.arange(25, dtype=np.float32).reshape(5, 5)  # row r: 3 feature columns, then 2 embedding columns
    parts = []
    for rank in range(2):
        part = cache.PartialCache.create(tmp_path / f"shard{rank}.h5", attrs,
                                         {n: cache.SplitRows(ids[rank::2], labels[rank::2], None) for n in ("test",)}
                                         | {n: cache.SplitRows(ids[rank::2], labels[rank::2],
                                                               rows[n].observed[rank::2]) for n in ("train", "val")},
                                         shapes, text)
        for name in cache.SPLITS:
            bad = np.array([k == 2 and name == "test" for k in range(5)][rank::2])
            part.write_rows(name, np.arange(len(bad)), wide[rank::2], bad)
        parts.append(part)
    full = cache.PartialCache.create(tmp_path / "full.h5", attrs, rows, shapes, text)
    full.join_shards(parts)
    path, dropped = full.finalise({"created": "now"})
    assert dropped["test"] == ["2.jpg"]
    with h5py.File(path) as file:
        np.testing.assert_array_equal(file["train"]["features"][...], wide[:, :3])
        np.testing.assert_array_equal(file["train"]["image_embeddings"][...], wide[:, 3:])
        np.testing.assert_array_equal(file["test"]["image_embeddings"][...], wide[[0, 1, 3, 4], 3:])
        np.testing.assert_array_equal(file["text"]["embeddings"][...], text["embeddings"])
        assert json.loads(file["text"]["embeddings"].attrs["templates"]) == ["{}"]
