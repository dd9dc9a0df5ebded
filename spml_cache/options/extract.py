"""Stage one's options (`spml-cache extract`, `extract.run_extract`): what the cache holds (`ExtractOptions`) and
where and how this process computes it (`ExtractPlacement`: the cache is the same whatever they are); and those of
`spml-cache import-features` (`ImportOptions`: features made elsewhere into a cache)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spml_cache import backbones, datasets
from spml_cache.options.declared import Options, Placement, at_least, between, given, one_of, option
from spml_cache.options.text import DATASETS_HELP, RULES_HELP, either, read_rules

PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # what the trunk may run in (torch's)


def read_decode(value: str, flag: str) -> str:
    """`--decode`'s one reader, checked by the images' own rule (gpu or cpu)."""
    from spml_cache.images import check_decode

    check_decode(value, flag)
    return value


def decode_option(default: str, **declared):
    """`--decode`, declared once for the stages that decode JPEGs (extract, finetune): gpu or cpu, each the decoder
    `images.DECODERS` names; not given, what `default` says (and `declared`: how the stage resolves it)."""
    return given(None, "gpu (nvjpeg, on a CUDA device) or cpu (libjpeg-turbo in the loader processes: the CPU's pixels,"
                 f" as the papers' PIL within a level; docs/fidelity.md); default: {default}.", read=read_decode,
                 **declared)


def _label_format(value: str, flag: str) -> str:
    """`--labels`, checked by the cache's own rule (auto, dense or sparse)."""
    from spml_cache.cache.csr import resolve_format

    resolve_format(value, 0, flag)
    return value


@dataclass(frozen=True, kw_only=True)
class ExtractOptions(Options):
    """What to extract (docs/internals.md, "extract"): the options of `spml-cache extract` that make the cache."""

    dataset: str = option(help=f"{DATASETS_HELP}.", argument=True)
    backbone: str = option(
        backbones.DEFAULT, "resnet50 (the papers'), resnet101, vit_b_16, convnext_base or another torchvision model;"
        " timm:NAME; clip:ARCH/TAG; your own module:callable, path/to/file.py:callable or spml_cache.backbones entry"
        " point (docs/your-own-backbone.md).")
    weights: str | None = option(
        None, "resnet50: IMAGENET1K_V1 (default, the papers'), IMAGENET1K_V2; torchvision: an enum name (default"
        " DEFAULT); timm: pretrained (default) or a tag; clip: a tag (default: the name's); any: a local .pth, or none"
        " (random).")
    resolution: int | None = option(
        None, "The input side R (default: 448 for resnet50, squashed to R x R; else the backbone's own, resized and"
        " centre-cropped).", kind=int, check=between(32, 2048, "use a side between 32 and 2048 pixels (the papers"
                                                               " use 448)"))
    clip_features: str = option(backbones.DEFAULT_CLIP_FEATURES, "clip: post (after the projection, CLIP's README) or"
                                " pre (before it, the CLIP paper's probes).")
    prompts: str = option(backbones.DEFAULT_PROMPTS, "clip: the text templates, default ('a photo of a {}.'), vlpl, or"
                          " a file with one template per line.")
    crops: int = option(0, "clip: also the embeddings of a G x G grid of crops of each image (G >= 2; GPR's crop"
                        " pseudo-labels).")
    features: str = option(
        backbones.DEFAULT_FEATURES, "pooled (the pooled vector) or last4: a ViT's last four blocks' class tokens and"
        " last block's mean patch token, a CNN's last four stages average-pooled, concatenated (DINOv2's linear"
        " evaluation); the kind names the cache.", check=one_of(*backbones.FEATURES, fix="use pooled (the pooled"
                                                                " vector) or last4 (the last four blocks or stages, concatenated)"))
    precision: str = option("auto", "auto (fp16 on a GPU, fp32 on the CPU), fp32, fp16 or bf16.",
                            check=one_of("auto", *PRECISION_DTYPES))
    decode: str | None = decode_option("gpu on a GPU, cpu elsewhere")
    limit: int | None = option(None, "Only the first N images of each split (protocol drawn on the full dataset).",
                               kind=int, check=at_least(1, fix="use at least 1 image per split (or leave it out for"
                                                                " all)"))
    on_bad_image: str = option("fail", "fail (name the file and stop) or skip (leave the image out, listed in the"
                               " attrs).", check=one_of("fail", "skip"))
    skip_missing: bool = option(False, "Leave out images whose file is missing (recorded in the attrs).", switch=True)
    observe: list | None = option(
        None, f"Observation rules to store beside single, a comma list: {RULES_HELP} (docs/protocol.md); a complete"
        " cache gets the ones it lacks.", read=read_rules)  # rules whose masks to store (extract/rules.py)
    labels: str = option("auto", "How the cache stores its label matrices: auto (the default: sparse CSR from 1,000"
                         " classes), dense or sparse.", read=_label_format)


@dataclass(frozen=True, kw_only=True)
class ExtractPlacement(Placement):
    """Where the images are, where the cache goes, and how this process computes it."""

    root: Path | None = option(None, "The dataset's folder (default: $SPML_DATA).", kind=Path)
    out: Path | None = option(None, "Cache file (default: $SPML_CACHE or ./cache, <dataset>-<backbone>-<R>.h5, the"
                              " backbone's - : / as _).", kind=Path)
    batch_size: int = option(64, "Images per forward pass.", check=at_least(1))
    workers: int | None = option(None, "Loader processes (default: 8 on a GPU, cores/4 on the CPU).", kind=int,
                                 check=at_least(0, fix="use 0 (load in the main process) or more"))
    device: str = option("auto", "auto, cuda, cuda:N or cpu.")
    dry_run: bool = option(False, "Print counts, missing files and the output size; write nothing.", switch=True)
    force: bool = option(False, "Rebuild even if a cache or partial file with these or other settings exists.",
                         switch=True)
    # no flag: None is on for a GPU, off for the CPU; the tests force them on the CPU to show that the cache does not
    # depend on them
    pad_batches: bool | None = option(None, "Pad every trunk input to the run's batch size.", kind=bool, flag="")
    feed_thread: bool | None = option(None, "Decode in the feed thread.", kind=bool, flag="")


PUBLISHED_HELP = either(list(datasets.values_of("PUBLISHED_ID_PREFIX")))  # the datasets import-features knows


@dataclass(frozen=True, kw_only=True)
class ImportOptions(Options):
    """`spml-cache import-features`: the folder of features computed elsewhere (the authors' published files, or
    the clip-retrieval layout), which dataset they are of, and the cache to write."""

    folder: Path = option(help="Folder with the authors' formatted_*.npy and *_features_imagenet_resnet50.npy, or"
                          " embeddings in the clip-retrieval layout (img_emb/img_emb_{i}.npy,"
                          " metadata/metadata_{i}.parquet).", kind=Path, argument=True)
    dataset: str | None = option(None, f"{PUBLISHED_HELP} (decides the image-id prefix; with the clip-retrieval"
                                 " layout, the dataset read under --root; an spml-cache export names its own).",
                                 kind=str)
    root: Path | None = option(None, "clip-retrieval layout from other tools: the dataset's folder, whose images the"
                               " embedding rows are matched to by id or image_path (default: $SPML_DATA); an"
                               " spml-cache export needs none.", kind=Path)
    out: Path | None = option(None, "Cache file (default: $SPML_CACHE or ./cache, <dataset>-resnet50-448.h5;"
                              " clip-retrieval layout: <dataset>-<backbone>-<R>.h5, imported-0 when the folder does"
                              " not say; never the cache an export was made from).", kind=Path)
    classes: Path | None = option(None, "Text file with the class names, one per line (VOC's are built in).",
                                  kind=Path)
    force: bool = option(False, "Replace an existing cache at --out.", switch=True)
