"""The ResNet-50 trunk, its weights (enum, file, none, offline), JPEG decoding and the papers' preprocessing."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
import torch
import torchvision
from extract_support import random_weights, truncate, write_jpeg
from PIL import Image

from spml_cache.backbones.checkpoints import RandomWeightsWarning
from spml_cache.backbones.resnet50 import build_trunk
from spml_cache.images import ImageDecodeError, decode_jpegs, preprocess
from spml_cache.runtime.errors import SpmlError

MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])


def pooled_features(model: torchvision.models.ResNet, x: torch.Tensor) -> torch.Tensor:
    """ResNet-50 up to global average pooling, spelled out layer by layer."""
    x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
    x = model.layer4(model.layer3(model.layer2(model.layer1(x))))
    return torch.flatten(model.avgpool(x), 1)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return random_weights(tmp_path_factory)


def test_trunk_from_file_is_resnet50_up_to_pooling(weights):
    trunk, provenance = build_trunk(str(weights))
    reference = torchvision.models.resnet50()
    reference.load_state_dict(torch.load(weights, weights_only=True))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = pooled_features(reference.eval(), x)
        got = trunk.eval()(x)
    assert got.shape == (2, 2048)
    torch.testing.assert_close(got, expected)
    assert provenance == "sha256:" + hashlib.sha256(weights.read_bytes()).hexdigest()
    assert all(p.requires_grad for p in trunk.parameters())  # trainable as returned (finetune relies on it)


def test_wrapped_checkpoint_with_prefix_loads(tmp_path, weights):
    state = torch.load(weights, weights_only=True)
    wrapped = {"state_dict": {f"module.{k}": v for k, v in state.items() if "num_batches_tracked" not in k}}
    path = tmp_path / "ddp.pth"
    torch.save(wrapped, path)
    trunk, _ = build_trunk(str(path))
    assert torch.equal(trunk.state_dict()["layer4.2.conv3.weight"], state["layer4.2.conv3.weight"])
    assert torch.equal(trunk.state_dict()["bn1.running_var"], state["bn1.running_var"])


def test_random_init_warns_and_is_the_same_network_every_time():
    torch.manual_seed(5)
    expected_draw = torch.rand(1)
    torch.manual_seed(5)
    with pytest.warns(RandomWeightsWarning, match="not ImageNet features"):
        first, provenance = build_trunk("none")
    assert torch.equal(torch.rand(1), expected_draw)  # the caller's random stream is left alone
    with pytest.warns(RandomWeightsWarning):
        second, _ = build_trunk("none")
    assert provenance == "none"
    # a resumed extraction with --weights none continues with the same network
    for (key, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), key
    with torch.no_grad():
        assert first.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 2048)


class Pickled:
    """Not a tensor: torch.load(weights_only=True) must refuse it, and the message must not advise otherwise."""


@pytest.mark.parametrize("case", ["resnet18", "not_a_state_dict", "text", "random_bytes", "pickled_object", "missing"])
def test_a_file_that_is_not_a_resnet50_state_dict_is_a_clear_error(tmp_path, case):
    path = tmp_path / f"{case}.pth"
    if case == "resnet18":
        torch.save(torchvision.models.resnet18().state_dict(), path)
    elif case == "not_a_state_dict":
        torch.save({"weights": [1, 2, 3]}, path)
    elif case == "text":
        path.write_text("hello")
    elif case == "random_bytes":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif case == "pickled_object":
        torch.save({"conv1.weight": Pickled()}, path)
    with pytest.raises(SpmlError, match=str(path)) as error:
        build_trunk(str(path))
    assert "\n" not in str(error.value) and "weights_only" not in str(error.value)
    expected = {"resnet18": "not a ResNet-50 state dict", "not_a_state_dict": "not a state dict",
                "text": "not a loadable", "random_bytes": "not a loadable", "pickled_object": "Python objects besides",
                "missing": "no such file"}[case]  # fmt: skip
    assert expected in str(error.value)


def test_offline_enum_weights_fail_fast_naming_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("SPML_OFFLINE", "1")
    with pytest.raises(SpmlError) as error:
        build_trunk("IMAGENET1K_V1")
    message = str(error.value)
    assert "resnet50-0676ba61.pth" in message and str(tmp_path) in message and "TORCH_HOME" in message
    assert "--weights PATH" in message and "--weights none" in message
    assert not (tmp_path / "hub" / "checkpoints" / "resnet50-0676ba61.pth").exists()


def test_cached_enum_weights_are_used(tmp_path, monkeypatch, weights):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("SPML_OFFLINE", "1")
    cached = tmp_path / "hub" / "checkpoints" / "resnet50-11ad3fa6.pth"  # IMAGENET1K_V2's file name
    cached.parent.mkdir(parents=True)
    cached.write_bytes(weights.read_bytes())
    trunk, provenance = build_trunk("imagenet1k_v2")
    assert provenance == "IMAGENET1K_V2"
    assert torch.equal(trunk.state_dict()["conv1.weight"], torch.load(weights, weights_only=True)["conv1.weight"])


def test_decode_matches_pil_and_flags_bad_files(tmp_path):
    write_jpeg(tmp_path / "a.jpg", seed=1, size=(30, 40))
    write_jpeg(tmp_path / "b.jpg", seed=2)
    truncate(tmp_path / "b.jpg")
    png = io.BytesIO()
    Image.fromarray(np.full((5, 6, 3), 200, dtype=np.uint8)).save(png, format="PNG")
    blobs = [(tmp_path / "a.jpg").read_bytes(), (tmp_path / "b.jpg").read_bytes(), png.getvalue(), b""]
    images = decode_jpegs(blobs, "cpu", skip_bad=True)
    expected = np.asarray(Image.open(tmp_path / "a.jpg").convert("RGB")).transpose(2, 0, 1)
    assert images[0].dtype == torch.uint8 and images[0].shape == (3, 30, 40)
    assert np.abs(images[0].numpy().astype(int) - expected.astype(int)).max() <= 1
    assert images[1] is None and images[3] is None  # truncated, empty
    assert images[2].shape == (3, 5, 6) and int(images[2].min()) == 200  # a PNG under a .jpg name
    with pytest.raises(ImageDecodeError) as error:
        decode_jpegs(blobs[:2], "cpu")
    assert error.value.index == 1 and "truncated" in error.value.reason


def test_a_gpu_decode_drains_the_current_stream_first(tmp_path, monkeypatch):
    """nvjpeg writes without waiting for the work queued on its stream (torchvision pull request 9606), so
    `decode_jpegs`, the one way every stage decodes on a GPU, drains the current stream before it. On the CPU, with
    stand-ins for the stream and for the GPU decoder that log the order of the calls (the real race is checked in
    tests/test_extract_gpu.py)."""
    calls = []

    class Stream:
        def synchronize(self) -> None:
            calls.append("drain")

    cpu_decode = torchvision.io.decode_jpeg

    def gpu_decode(data, mode, device):
        calls.append(f"decode {len(data)} on {device}")
        return [cpu_decode(datum, mode=mode) for datum in data]

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torchvision.io, "decode_jpeg", gpu_decode)
    for seed in range(2):
        write_jpeg(tmp_path / f"{seed}.jpg", seed=seed)
    images = decode_jpegs([(tmp_path / f"{seed}.jpg").read_bytes() for seed in range(2)], "cuda")
    assert calls == ["drain", "decode 2 on cuda"]
    assert [tuple(image.shape) for image in images] == [(3, 24, 32)] * 2


def test_preprocess_is_the_papers_resize_and_normalisation(tmp_path):
    sizes = [(30, 40), (17, 50), (30, 40)]  # interleaved: resized in two groups, placed back in order
    images = []
    for seed, size in enumerate(sizes):
        write_jpeg(tmp_path / f"{seed}.jpg", seed=seed, size=size)
        pixels = np.asarray(Image.open(tmp_path / f"{seed}.jpg").convert("RGB"))
        images.append(torch.from_numpy(pixels.transpose(2, 0, 1).copy()))
    batch = preprocess(images, 24)
    assert batch.shape == (3, 3, 24, 24) and batch.dtype == torch.float32
    assert batch.is_contiguous(memory_format=torch.channels_last)
    for k in range(len(sizes)):
        # The reference: PIL Resize((R, R)) (bilinear, antialiased) -> ToTensor -> Normalize(ImageNet).
        resized = np.asarray(Image.open(tmp_path / f"{k}.jpg").convert("RGB").resize((24, 24), Image.BILINEAR))
        expected = ((resized / 255.0 - MEAN) / STD).transpose(2, 0, 1)
        difference = np.abs(batch[k].numpy() - expected)
        assert difference.max() <= 1.01 / 255 / STD.min()  # at most one uint8 level apart from PIL
        assert difference.mean() < 0.1 / 255 / STD.min()


def test_weights_that_cannot_be_downloaded_are_one_short_line(tmp_path, monkeypatch):
    """Without SPML_OFFLINE the weights are fetched when missing; offline, urllib's error becomes its reason."""
    import socket
    import urllib.error

    def unreachable(*args, **kwargs):
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.delenv("SPML_OFFLINE", raising=False)
    monkeypatch.setattr(torch.hub, "download_url_to_file", unreachable)
    with pytest.raises(SpmlError) as error:
        build_trunk("IMAGENET1K_V1")
    message = str(error.value)
    assert "could not be downloaded ([Errno -2] Name or service not known)" in message
    assert "urlopen" not in message and "\n" not in message and "--weights PATH" in message
