"""Fine-tuning another backbone's cache: the trunk rebuilt from the cache's `backbone` and `weights` attrs with its
own preprocessing (LinearInit's model gives the linear head's logits on the cached features), one epoch end to
end with a timm backbone; a CLIP cache refused in one line."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from backbone_support import TINY_CLIP, register_tiny_clip
from rich.console import Console

from spml_cache import cache, extract, finetune, linear
from spml_cache.demo import data as demo_data
from spml_cache.finetune import images as data, parallel
from spml_cache.finetune.model import initial_model
from spml_cache.finetune.settings import FinetuneOptions, resolve
from spml_cache.runtime.errors import SpmlError

pytestmark = pytest.mark.filterwarnings("ignore::spml_cache.backbones.checkpoints.RandomWeightsWarning")
BACKBONE = "timm:resnet10t"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("finetune-backbones")
    root = demo_data.make_demo_data(base / "data", num_train=12, num_test=4, size=40, seed=0)
    cache_path = extract.extract("voc", root, out=base, backbone=BACKBONE, weights="none", resolution=32,
                                 batch_size=8, workers=0, device="cpu").path
    run = linear.run_linear(cache=cache_path, losses=["an"], lrs=[1e-3], batch_sizes=[4], epochs=1,
                            out=base / "runs", device="cpu", console=Console(file=io.StringIO())).run_dir
    return SimpleNamespace(base=base, root=root, cache=cache_path, runs=base / "runs", linear=run)


def test_the_timm_trunk_is_rebuilt_as_extracted(world):
    assert world.cache.name == "voc-timm_resnet10t-32.h5"
    options = FinetuneOptions(init="best", cache=world.cache, loss="an", batch_sizes=[4])
    setup = resolve(options, None, root=world.root, out=world.runs, cache_dir=None,
                    processes=parallel.start_processes("cpu"), workers=0)
    assert setup.settings.options.weights == "none" and setup.preprocess.interpolation == "bicubic"
    features = setup.features.train
    files = data.ImageFiles(setup.root, features.ids[:4], decode="cpu")
    model = initial_model(setup).eval()
    with torch.no_grad():
        logits = model(data.model_input([files[row][1] for row in range(4)], setup.preprocess, torch.device("cpu")))
    head = setup.start
    expected = features.features[:4] @ head.weight.numpy().T + head.bias.numpy()
    np.testing.assert_allclose(logits.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_one_epoch_end_to_end_with_a_timm_backbone(world):
    lines = []
    results = finetune.finetune(init="best", cache=world.cache, root=world.root, loss="an", lrs=[1e-4],
                                batch_sizes=[4], epochs=1, workers=0, device="cpu", out=world.runs, log=lines.append)
    assert lines[0].startswith(f"LinearInit from {world.linear}")
    assert (Path(results["run_dir"]) / "best.pt").is_file()


def test_a_clip_cache_is_refused_in_one_line(world, tmp_path):
    register_tiny_clip(tmp_path)
    clip_cache = extract.extract("voc", world.root, out=tmp_path, backbone=f"clip:{TINY_CLIP}", weights="none",
                                 batch_size=8, workers=0, device="cpu", limit=4).path
    with pytest.raises(SpmlError, match="CLIP image tower, which spml-cache does not fine-tune") as error:
        finetune.finetune(init="imagenet", cache=clip_cache, root=world.root, loss="an", workers=0,
                          device="cpu", out=tmp_path / "runs")
    assert "\n" not in str(error.value)
    assert cache.load(clip_cache).attrs["backbone"] == f"clip:{TINY_CLIP}"
