"""The backbone registry: names and families, each family built at random weights, its preprocessing recorded,
ResNet-50's settings unchanged, CLIP's embeddings and text side, bad names and missing extras in one line."""

from __future__ import annotations

import builtins

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from backbone_support import register_tiny_clip

from spml_cache import backbones, cache
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.runtime.errors import SpmlError

pytestmark = pytest.mark.filterwarnings("ignore::spml_cache.backbones.checkpoints.RandomWeightsWarning")


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return register_tiny_clip(tmp_path_factory.mktemp("clip"))


def images(count: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (3, 40 + 3 * k, 50), dtype=torch.uint8, generator=generator) for k in range(count)]


def test_resnet50_records_what_it_always_recorded():
    described = backbones.describe("resnet50", "none")
    assert described.attrs() == {
        "backbone": "resnet50", "weights": "none", "resolution": 448,
        "resize": "448x448, bilinear, antialiased, no crop", "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225], "feature_dim": 2048,
    }  # fmt: skip
    assert described.slug == "resnet50" and described.row_shapes() == {"features": (2048,)}
    assert backbones.describe().weights == "IMAGENET1K_V1"
    assert cache.default_path("voc", 448, "c", described.slug).name == "voc-resnet50-448.h5"


def test_names_pick_families_and_slugs_keep_find_cache_working(tmp_path):
    assert backbones.family_of("resnet50") == ("tv", "resnet50")
    assert backbones.family_of("tv:vit_b_16") == ("tv", "vit_b_16")
    assert backbones.family_of("clip:ViT-B-16/openai") == ("clip", "ViT-B-16/openai")
    assert backbones.slug("clip:ViT-B-16/openai") == "clip_ViT_B_16_openai"
    assert backbones.slug("timm:convnext_base.fb_in22k") == "timm_convnext_base.fb_in22k"
    for name in ("clip:ViT-B-16/openai", "timm:convnext_base.fb_in22k"):
        folder = tmp_path / backbones.slug(name)
        path = cache.default_path("voc", 224, folder, backbones.slug(name))
        folder.mkdir()
        path.write_bytes(b"")
        assert cache.find_cache(None, "voc", folder) == path


@pytest.mark.parametrize("name, message", [
    ("resnet5", "not a torchvision classification model"),
    ("foo:bar", "unknown backbone family 'foo'"),
    ("timm:no_such_net", "timm has no such model"),
    ("clip:No-Such-Arch/openai", "open_clip has no such model"),
])  # fmt: skip
def test_bad_names_are_one_line(name, message):
    with pytest.raises(SpmlError, match=message) as error:
        backbones.describe(name, "none")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("typed, meant", [
    ("resnet05", "resnet50"), ("vit_b_61", "vit_b_16"), ("tim:resnet10t", "timm"),
    ("timm:resnet10", "resnet10t"), ("clip:ViT-B-61/openai", "ViT-B-16"),
])  # fmt: skip
def test_a_misspelt_backbone_gets_the_closest_name(typed, meant):
    with pytest.raises(SpmlError) as error:
        backbones.describe(typed, "none")
    assert f"(did you mean {meant}?)" in str(error.value)


def test_a_missing_extra_names_the_pip_command(monkeypatch):
    real_import = builtins.__import__

    def no_timm(name, *args, **kwargs):
        if name == "timm" or name.startswith("timm."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_timm)
    monkeypatch.setattr("importlib.import_module", lambda name: no_timm(name))
    with pytest.raises(SpmlError, match=r'pip install "spml-cache\[timm\]"'):
        backbones.describe("timm:resnet10t", "none")


def test_torchvision_model_at_random_weights_and_from_a_file(tmp_path):
    described = backbones.describe("tv:resnet18", "none", 32)
    assert described.feature_dim == 512 and described.preprocess.resize == 37  # 32 * 256 / 224
    assert described.attrs()["resize"] == "shorter side 37, bilinear, antialiased, centre crop 32x32"
    trunk = backbones.build(described).eval()
    reference = torchvision.models.resnet18()
    reference.load_state_dict({k: v for k, v in trunk.state_dict().items()}, strict=False)
    torch.save(reference.state_dict(), tmp_path / "r18.pth")
    from_file = backbones.describe("resnet18", str(tmp_path / "r18.pth"), 32)
    assert from_file.provenance.startswith("sha256:")
    x = described.preprocess(images())
    with torch.no_grad():
        r = reference.eval()  # ResNet-18 up to global average pooling, spelled out
        y = r.layer4(r.layer3(r.layer2(r.layer1(r.maxpool(r.relu(r.bn1(r.conv1(x))))))))
        expected = torch.flatten(r.avgpool(y), 1)
        torch.testing.assert_close(trunk(x), expected)
        torch.testing.assert_close(backbones.build(from_file).eval()(x), expected)


def test_torchvision_enum_weights_offline_name_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("SPML_OFFLINE", "1")
    described = backbones.describe("resnet18", None, 32)
    assert described.provenance == "IMAGENET1K_V1"
    with pytest.raises(SpmlError, match=r"resnet18-f37072fd\.pth.*TORCH_HOME=.*SPML_OFFLINE is set.*--weights none"):
        backbones.build(described)
    with pytest.raises(SpmlError, match="resnet18's weights are IMAGENET1K_V1"):
        backbones.describe("resnet18", "IMAGENET9K", 32)


def test_timm_model_records_its_pretrained_config():
    described = backbones.describe("timm:resnet10t", "none", 32)
    assert described.backbone == "timm:resnet10t" and described.slug == "timm_resnet10t"
    assert described.preprocess == Preprocess(32, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), resize=37,
                                                interpolation="bicubic")
    assert backbones.describe("timm:resnet10t", "pretrained").provenance == "resnet10t.c3_in1k"
    assert backbones.describe("timm:resnet10t", "pretrained").preprocess.resolution == 176  # its input_size
    for tag in ("c3_in1k", "resnet10t.c3_in1k"):  # a tag, or the provenance a cache records: the same weights
        assert backbones.describe("timm:resnet10t", tag).extra["source"] == "resnet10t.c3_in1k"
    with pytest.raises(SpmlError, match="not a pretrained tag of timm:resnet10t"):
        backbones.describe("timm:resnet10t", "bogus")
    trunk = backbones.build(described).eval()
    with torch.no_grad():
        assert trunk(described.preprocess(images())).shape == (2, described.feature_dim)


def test_timm_weights_missing_offline_are_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(SpmlError, match="not in the hub cache .* with HF_HUB_OFFLINE set .*--weights PATH") as error:
        backbones.build(backbones.describe("timm:resnet10t", "pretrained", 32))
    assert "\n" not in str(error.value) and "--weights none" in str(error.value)


def test_clip_rows_are_features_then_the_normalised_embedding(tiny_clip):
    post = backbones.describe(f"clip:{tiny_clip}", "none")
    pre = backbones.describe(f"clip:{tiny_clip}", "none", clip_features="pre")
    assert post.attrs()["clip_features"] == "post" and pre.attrs()["clip_features"] == "pre"
    assert (post.feature_dim, pre.feature_dim, post.embed_dim) == (16, 32, 16)
    assert post.row_shapes() == {"features": (16,), "image_embeddings": (16,)}
    assert post.preprocess.interpolation == "bicubic" and post.preprocess.resize == 32
    x = post.preprocess(images())
    post_trunk, pre_trunk = backbones.build(post).eval(), backbones.build(pre).eval()
    with torch.no_grad():
        model = post_trunk.model
        embedding = model.encode_image(x)  # CLIP's own image embedding
        row = post_trunk(x)
        torch.testing.assert_close(row[:, :16], embedding)
        torch.testing.assert_close(row[:, 16:], F.normalize(embedding, dim=-1))
        pre_row = pre_trunk(x)
        torch.testing.assert_close(pre_row[:, 32:], row[:, 16:])
        torch.testing.assert_close(pre_row[:, :32] @ pre_trunk.proj, embedding)


def test_clip_text_side_is_the_normalised_mean_of_normalised_prompts(tiny_clip):
    import open_clip

    trunk = backbones.build(backbones.describe(f"clip:{tiny_clip}", "none")).eval()
    templates = ["a photo of a {}.", "{}"]
    got = trunk.class_embeddings(backbones.class_prompts(["cat", "potted_plant"], templates))
    tokenizer = open_clip.get_tokenizer(tiny_clip)
    with torch.no_grad():
        for row, name in zip(got, ["cat", "potted plant"]):
            each = trunk.model.encode_text(tokenizer([f"a photo of a {name}.", name]))
            each = each / each.norm(dim=-1, keepdim=True)
            mean = each.mean(0)
            np.testing.assert_allclose(row, (mean / mean.norm()).numpy(), rtol=1e-5, atol=1e-6)


def test_clip_weights_and_flags_are_checked(tiny_clip):
    with pytest.raises(SpmlError, match="name its pretrained tag"):
        backbones.describe(f"clip:{tiny_clip}")
    with pytest.raises(SpmlError, match="--clip-features pre: RN50"):
        backbones.describe("clip:RN50/openai", clip_features="pre")
    with pytest.raises(SpmlError, match="--clip-features sideways"):
        backbones.describe(f"clip:{tiny_clip}", "none", clip_features="sideways")
    with pytest.raises(SpmlError, match="only for clip"):
        backbones.describe("resnet18", "none", clip_features="pre")


def test_prompt_templates(tmp_path):
    assert backbones.prompts() == ["a photo of a {}."]
    assert backbones.prompts("vlpl") == ["{}"]
    (tmp_path / "t.txt").write_text("a {} here\n\nthe {}\n")
    assert backbones.prompts(str(tmp_path / "t.txt")) == ["a {} here", "the {}"]
    (tmp_path / "bad.txt").write_text("no slot\n")
    with pytest.raises(SpmlError, match="'no slot' does not"):
        backbones.prompts(str(tmp_path / "bad.txt"))
    with pytest.raises(SpmlError, match="--prompts nowhere: use default, vlpl"):
        backbones.prompts("nowhere")
    assert backbones.class_prompts(["potted_plant"], ["a {}."]) == [["a potted plant."]]


def test_clip_crops_are_the_grid_of_the_loaded_square(tiny_clip):
    described = backbones.describe(f"clip:{tiny_clip}", "none", crops=2)
    assert described.preprocess.resolution == 64 and described.attrs()["resolution"] == 32
    assert described.row_shapes() == {"features": (16,), "image_embeddings": (16,), "crop_embeddings": (4, 16)}
    assert "cut into 2x2 crops of 32x32" in described.attrs()["resize"]
    trunk = backbones.build(described).eval()
    x = described.preprocess(images())
    with torch.no_grad():
        row = trunk(x)
        assert row.shape == (2, 16 + 16 + 4 * 16)
        model = trunk.model
        whole = F.interpolate(x, size=(32, 32), mode="bilinear", antialias=True)
        torch.testing.assert_close(row[:, :16], model.encode_image(whole))
        top_right = x[:, :, :32, 32:]  # crop 1 in row-major order
        torch.testing.assert_close(row[:, 32 + 16 : 32 + 32], F.normalize(model.encode_image(top_right), dim=-1))
    with pytest.raises(SpmlError, match="--crops 1: use 2 or more"):
        backbones.describe(f"clip:{tiny_clip}", "none", crops=1)
    with pytest.raises(SpmlError, match="for clip:ARCH/TAG backbones only"):
        backbones.describe("resnet18", "none", crops=2)


def test_clip_weights_missing_offline_are_one_line_naming_the_hub_repository(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    described = backbones.describe("clip:RN50/openai", clip_features="post")
    assert described.provenance == "openai" and described.embed_dim == 1024
    with pytest.raises(SpmlError, match=r"\(timm/resnet50_clip.openai\) are not in the hub cache") as error:
        backbones.build(described)
    assert "\n" not in str(error.value) and "ERROR" not in capfd.readouterr().err
    assert "--weights none" in str(error.value)
