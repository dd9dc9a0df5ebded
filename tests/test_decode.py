"""The JPEG decoder as a recorded choice (docs/fidelity.md, "What a GPU cache differs in"): `extract --decode
gpu|cpu` and `finetune --decode`, the cache's `decoder` attr (one of the settings that make a cache another one),
caches from before the attr, and fine-tuning decoding as its cache did. What needs a GPU is in
tests/test_extract_gpu.py and tests/test_cuda.py."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
import torchvision
from cli_support import one_error_line
from extract_support import REPO, random_weights, write_numbered_csv_dataset

from spml_cache import cache
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.extract import extract
from spml_cache.extract.batches import BatchRun, _loader
from spml_cache.finetune.settings import FinetuneOptions, Resumed, _decode
from spml_cache.images import recorded_decoder, resolve_decode
from spml_cache.runtime.errors import SpmlError

CPU, GPU = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU; nothing here runs on one


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_numbered_csv_dataset(tmp_path_factory.mktemp("decode"), 6, first_test=4)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return random_weights(tmp_path_factory)


def test_the_default_is_nvjpeg_where_it_runs_and_gpu_decoding_on_the_cpu_is_refused_naming_the_flag():
    assert (resolve_decode(None, GPU), resolve_decode(None, CPU)) == ("gpu", "cpu")
    assert (resolve_decode("cpu", GPU), resolve_decode("gpu", torch.device("cuda:1"))) == ("cpu", "gpu")
    with pytest.raises(SpmlError, match=r"^--decode gpu: nvjpeg needs a CUDA device, .* pass --decode cpu") as error:
        resolve_decode("gpu", CPU)
    assert "\n" not in str(error.value)
    with pytest.raises(SpmlError, match=r"^--decode jpeg: use gpu .* or cpu"):
        FinetuneOptions(decode="jpeg")


@pytest.mark.parametrize("command", ["extract", "finetune"])
def test_the_command_line_refuses_an_unknown_decoder_in_one_line(data, tmp_path, monkeypatch, capsys, command):
    args = ["extract", "csv", "--root", str(data)] if command == "extract" else ["finetune", "--dataset", "voc"]
    line = one_error_line([*args, "--device", "cpu", "--decode", "jpeg"], subprocess_too=False, cwd=tmp_path,
                          monkeypatch=monkeypatch, capsys=capsys)
    assert line.startswith("error: --decode jpeg: use gpu")


def test_cli_extract_refuses_gpu_decoding_on_the_cpu_in_one_line(data, tmp_path, monkeypatch, capsys):
    line = one_error_line(["extract", "csv", "--root", str(data), "--device", "cpu", "--decode", "gpu", "--out",
                           str(tmp_path / "c.h5")], subprocess_too=False, cwd=tmp_path, monkeypatch=monkeypatch,
                          capsys=capsys)
    assert line.startswith("error: --decode gpu: nvjpeg needs a CUDA device") and not (tmp_path / "c.h5").exists()


def test_a_cache_records_its_decoder_and_one_from_before_the_attr_is_judged_by_its_device(data, weights, tmp_path):
    out = tmp_path / "c.h5"
    given = dict(out=out, weights=str(weights), resolution=32, limit=1, workers=0, device="cpu")
    report = extract("csv", data, **given)
    attrs = cache.load(out).attrs
    assert report.decoder == attrs["decoder"] == "libjpeg-turbo" == recorded_decoder(attrs)
    assert f"torchvision {torchvision.__version__}" in attrs["decoder_version"]
    with h5py.File(out, "a") as file:  # as extraction wrote it before the attr existed
        del file.attrs["decoder"], file.attrs["decoder_version"]
    assert extract("csv", data, **given).status == "up to date"  # device "cpu": decoded on the CPU
    assert "decoder" not in cache.load(out).attrs  # and it loads as it did
    with h5py.File(out, "a") as file:
        file.attrs["device"] = "cuda:0 (NVIDIA H200)"  # an old GPU cache: nvjpeg decoded it
    with pytest.raises(SpmlError, match=r"other settings \(decoder: 'nvjpeg' in the file, 'libjpeg-turbo' now\)"):
        extract("csv", data, **given)
    with h5py.File(out, "a") as file:
        file.attrs["device"], file.attrs["decoder"] = "cpu", "nvjpeg"  # recorded wins over the device
    with pytest.raises(SpmlError, match=r"decoder: 'nvjpeg' in the file"):
        extract("csv", data, **given)
    assert recorded_decoder({"device": "unknown (the authors' features)"}) is None and recorded_decoder({}) is None


def first_payload(device: torch.device, decode: str, data):
    """What the extraction loop receives for the first batch of 4 images, as a run on `device` builds its loader
    (nothing is moved to that device here)."""
    paths = [data / "images" / f"{k}.jpg" for k in range(4)]
    run = BatchRun(preprocess=Preprocess(32), width=2048, batch_size=4, workers=0, device=device, precision="fp32",
                   skip_bad=False, label="test", backbone="resnet50", decode=decode)
    loader, _ = _loader([("train", np.arange(4))], {"train": paths}, run, feed_thread=device.type == "cuda")
    return next(iter(loader))[2]


def test_with_decode_cpu_a_gpu_run_gets_the_cpu_runs_pixels_from_its_loader_workers(data):
    on_cpu = first_payload(CPU, "cpu", data)
    assert on_cpu.dtype == torch.uint8 and on_cpu.shape == (4, 3, 32, 32)
    assert torch.equal(first_payload(GPU, "cpu", data), on_cpu)  # decoded and resized on the CPU, byte for byte
    blobs = first_payload(GPU, "gpu", data)  # nvjpeg's: the files' bytes, decoded on the GPU
    assert blobs == [(data / "images" / f"{k}.jpg").read_bytes() for k in range(4)]


def features(decoder: str | None) -> SimpleNamespace:
    attrs = {"device": "cpu"} if decoder is None else {"decoder": decoder}
    return SimpleNamespace(attrs=attrs, path="voc.h5")


def test_finetune_decodes_as_its_cache_did_where_the_device_allows_and_says_so_where_not():
    assert _decode(None, features("nvjpeg"), GPU, None) == ("gpu", None)
    assert _decode(None, features("libjpeg-turbo"), GPU, None) == ("cpu", None)  # the CPU's pixels on a GPU
    assert _decode(None, features(None), GPU, None) == ("cpu", None)  # an old CPU cache: by its device
    assert _decode(None, SimpleNamespace(attrs={}, path="x.h5"), GPU, None) == ("gpu", None)  # unknown: the device's
    decode, warning = _decode(None, features("nvjpeg"), CPU, None)
    assert decode == "cpu" and warning.startswith("warning: voc.h5 was decoded with nvjpeg, which needs a GPU")
    assert "\n" not in warning and "epoch 0 is not exactly the linear head" in warning
    assert _decode("cpu", features("nvjpeg"), GPU, None) == ("cpu", None)  # given: as given
    with pytest.raises(SpmlError, match=r"^--decode gpu: nvjpeg needs a CUDA device"):
        _decode("gpu", features("nvjpeg"), CPU, None)
    with pytest.raises(SpmlError, match=r"^--resume run: that run decodes its images with nvjpeg.*resume it on a GPU"):
        _decode("gpu", features("nvjpeg"), CPU, SimpleNamespace(run_dir="run"))


TAKEN = FinetuneOptions(init="best", loss="an", dataset="voc", cache=Path("/c.h5"), from_run=Path("/r"),
                        weights="none", resolution=32, epochs=1, lrs=[1e-3], batch_sizes=[8], seeds=1,
                        head_lr_mult=1.0, skip_missing=False, hparams={}, fidelity="exact", decode="gpu")


def test_a_resumed_finetune_keeps_its_decoder_and_refuses_another(tmp_path):
    taken = TAKEN
    assert taken.stored()["decode"] == "gpu" and FinetuneOptions.from_stored(taken.stored()) == taken
    assert taken.decode == "gpu" and taken.differences(taken) == []
    assert FinetuneOptions(decode="cpu").differences(taken) == [("--decode", "cpu", "gpu")]
    facts = {"stage": "finetune", "root": "data", "cache_id": "abc"}
    (tmp_path / "config.json").write_text(json.dumps({**facts, **taken.stored(), "device": "cpu"}))
    assert Resumed.read(tmp_path).options == taken  # kept, whatever the device
    for device, decoded in (("cuda:0", "gpu"), ("cpu", "cpu")):  # a run from before --decode: as its device did
        options = {key: value for key, value in taken.stored().items() if key != "decode"}
        (tmp_path / "config.json").write_text(json.dumps({**facts, "options": options, "device": device}))
        assert Resumed.read(tmp_path).options == replace(taken, decode=decoded)


def test_bench_decode_writes_the_cpu_decoders_rate_per_core_as_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_decode", REPO / "scripts" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--images", "4", "--resolution", "32", "--batch-size", "2", "--device", "cpu", "--json",
                str(tmp_path / "decode.json")])
    written = json.loads((tmp_path / "decode.json").read_text())
    rates = written["cpu_one_thread"]["images_per_s"]
    assert rates["decode"] > 0 and rates["decode_resize"] > 0 and "gpu" not in written
    assert written["settings"]["images"] == 4 and "libjpeg-turbo" in written["cpu_one_thread"]["decoder"]
