"""Stage one: run a frozen backbone (backbones/: ResNet-50 by default) over a dataset once and write the HDF5
feature cache; for a CLIP backbone also its normalised image embeddings and the class prompts' text embeddings.

`extract` reads the dataset, applies the protocol to the *full* dataset, fills `<out>.partial` batch by batch
and renames it to `<out>` when every row is done; re-running resumes from the partial file, and a complete
cache with the same settings is left alone unless `force`.

On a GPU, loader workers only read file bytes; a background thread (feed.py) decodes each batch with nvjpeg,
resizes and normalises it on a CUDA stream of its own while the main thread runs the trunk on the previous one
under fp16/bf16 autocast in channels_last; features come back through a ring of pinned buffers one batch
behind, so the copy and the HDF5 write overlap the next batch. Every batch the trunk sees is padded to the
run's one batch size (a split's last batch, a batch with bad images), so cuDNN's autotuning (`benchmark`) runs
once, not once per new shape; the padding rows are dropped before anything is checked or written. On the CPU,
workers decode and resize, and nothing is padded (the model is the bottleneck there, and padding is compute).

A corrupt or truncated image stops the run naming the file (`on_bad_image="fail"`), or (`"skip"`) is flagged
in the partial file and its row dropped when the cache is finalised, its id listed in the `skipped_images`
attr: no row ever carries features of an image that was not decoded. No row carries a non-finite feature
either (writer.py): rows non-finite in fp16/bf16 are recomputed in fp32 and counted in `recomputed_fp32`;
a row non-finite even in fp32 is treated as a bad image.
"""

from __future__ import annotations

import importlib
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
import torchvision

import spml_cache
from spml_cache import backbones, cache, datasets, protocol
from spml_cache.extract import shards, writer
from spml_cache.extract.batches import PRECISIONS, run_batches
from spml_cache.runtime import locks
from spml_cache.extract.plan import (
    estimated_size, output_path, plan_rows, refuse_foreign_file, refuse_other_settings, require_room, require_writable,
    settings_attrs,
)
from spml_cache.cache.csr import DEFAULT_FORMAT, resolve_format
from spml_cache.extract.rules import RuleStore
from spml_cache.observation import Rule
from spml_cache.runtime.devices import default_workers, resolve_device
from spml_cache.runtime.errors import DiskFull, Interrupted, SpmlError

BAD_IMAGE_POLICIES = ("fail", "skip")


@dataclass
class ExtractReport:
    path: Path
    status: str  # "written", "up to date" or "dry run"
    counts: dict[str, int]  # rows per split of the cache (planned, for a dry run)
    extracted: int = 0  # rows computed by this run
    left_out: int = 0  # of them, rows flagged bad (undecodable, or not finite even in fp32): not in the cache
    resumed: int = 0  # rows found already done in the partial file
    skipped: dict[str, list[str]] = field(default_factory=dict)  # undecodable images dropped, per split
    recomputed: dict[str, int] = field(default_factory=dict)  # rows recomputed in fp32 after non-finite fp16/bf16 features
    precision: str = ""  # what the trunk ran in: fp32, fp16 or bf16
    missing: list[str] = field(default_factory=list)  # image files missing on disk (reader's skip_missing)
    seconds: float = 0.0
    device: str = ""
    size_bytes: int = 0  # the cache file's size (estimated for a dry run)
    notes: list[str] = field(default_factory=list)

    @property
    def images_per_s(self) -> float:
        return self.extracted / self.seconds if self.seconds > 0 else 0.0


# --- provenance ------------------------------------------------------------------------------------------


def run_attrs(device: torch.device, family: str = "tv") -> dict:
    """Provenance of the process that finished the cache (and the version of the backbone's library)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    library = {"timm": "timm", "clip": "open_clip"}.get(family)
    versions = {f"{library}_version": importlib.import_module(library).__version__} if library else {}
    return {**versions,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "package_version": spml_cache.__version__,
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "device": f"{device} ({name})" if device.type == "cuda" else "cpu",
    }




def _text_side(trunk, classes: list[str], templates: list[str] | None) -> dict | None:
    """A CLIP backbone's class text embeddings (its prompt ensemble per class), computed once on its device."""
    if templates is None:
        return None
    embeddings = trunk.class_embeddings(backbones.class_prompts(list(classes), templates))
    return {"embeddings": embeddings, "templates": templates}


# --- the command -----------------------------------------------------------------------------------------


def _reported(report: ExtractReport, shard: shards.Shard | None) -> ExtractReport | None:
    """What the command reports: in one process, its report; under torchrun, rank 0's (after every rank leaves
    the process group)."""
    if shard is None:
        return report
    shard.ranks.leave()
    return report if shard.main else None


def _check_options(resolution, batch_size, workers, precision, limit, on_bad_image, labels) -> None:
    resolve_format(labels, 0)  # refuses anything but auto, dense and sparse, naming --labels
    if resolution is not None and not 32 <= resolution <= 2048:
        raise SpmlError(f"--resolution {resolution}: use a side between 32 and 2048 pixels (the papers use 448)")
    if batch_size < 1:
        raise SpmlError(f"--batch-size {batch_size}: use at least 1")
    if workers is not None and workers < 0:
        raise SpmlError(f"--workers {workers}: use 0 (load in the main process) or more")
    if precision not in ("auto", *PRECISIONS):
        raise SpmlError(f"--precision {precision}: use auto, fp32, fp16 or bf16")
    if limit is not None and limit < 1:
        raise SpmlError(f"--limit {limit}: use at least 1 image per split (or leave it out for all)")
    if on_bad_image not in BAD_IMAGE_POLICIES:
        raise SpmlError(f"--on-bad-image {on_bad_image}: use fail or skip")


def extract(
    dataset: str,
    root: Path,
    *,
    out: Path | None = None,
    backbone: str = backbones.DEFAULT,
    weights: str | None = None,
    resolution: int | None = None,
    clip_features: str = backbones.DEFAULT_CLIP_FEATURES,
    prompts: str = backbones.DEFAULT_PROMPTS,
    crops: int = 0,
    features: str = backbones.DEFAULT_FEATURES,
    batch_size: int = 64,
    workers: int | None = None,
    device: str = "auto",
    precision: str = "auto",
    limit: int | None = None,
    dry_run: bool = False,
    force: bool = False,
    on_bad_image: str = "fail",
    skip_missing: bool = False,
    pad_batches: bool | None = None,
    feed_thread: bool | None = None,
    observe: list[Rule] | None = None,
    labels: str | None = None,
) -> ExtractReport | None:
    """Build (or resume, or confirm) the feature cache of `dataset` under `root`; see the module docstring.
    `observe`: observation rules whose masks to store beside `single`'s (extract/rules.py); a complete cache
    that lacks some gets them without recomputing its features. `labels`: how the cache stores its label
    matrices, auto (CSR from `SPARSE_MIN_CLASSES` classes), dense or sparse (None: `DEFAULT_FORMAT`,
    so the command line need not import the cache package to show it); a sparse-read dataset (OpenImages) is
    densified only for a dense cache. `backbone`, `weights` (None: the backbone's default), `resolution` (None: its own), `clip_features`, `prompts`, `crops` and `features` (pooled or last4): see backbones/. Under
    torchrun every process extracts its share of the rows and rank 0 joins them (shards.py); the other ranks
    return None, rank 0 the report of the whole.

    `pad_batches` and `feed_thread` are internal (no flag): None is on for a GPU, off for the CPU; the tests
    force them on the CPU to show the cache does not depend on them."""
    labels = DEFAULT_FORMAT if labels is None else labels
    _check_options(resolution, batch_size, workers, precision, limit, on_bad_image, labels)
    limit = limit or 0
    shard = shards.current()  # under torchrun: this process's share of the rows (shards.py)
    torch_device = shard.device(resolve_device(device)) if shard else resolve_device(device)
    if precision == "auto":
        precision = "fp16" if torch_device.type == "cuda" else "fp32"
    # A dry run lists missing files instead of stopping on them.
    images = datasets.read(dataset, root, skip_missing=skip_missing or dry_run)
    protocol_result = protocol.apply_protocol(images)
    rows = plan_rows(protocol_result, limit)
    label_format = resolve_format(labels, len(images.classes))
    described = backbones.describe(backbone, weights, resolution, clip_features, crops, features)
    templates = backbones.prompts(prompts) if described.embed_dim else None
    settings = settings_attrs(images, protocol_result.attrs, described, precision, limit, templates)
    path = output_path(out, images.dataset, described.resolution, described.slug)
    own, writing = (shard.rows(rows), shard.path(path)) if shard else (rows, path)  # what this process writes
    partial_file = cache.partial_path(writing)
    counts = {name: len(split) for name, split in rows.items()}
    report = ExtractReport(path, "dry run", counts, missing=list(images.skipped), device=str(torch_device),
                           precision=precision)
    report.notes = list(images.notes)
    report.size_bytes = estimated_size(rows, len(images.classes), described.row_width, label_format)
    rule_store = RuleStore(observe, images, settings)  # reads instance areas when a rule needs them

    refuse_foreign_file(path)
    if path.exists() and not force:
        refuse_other_settings(path, settings, rows, "was built", "rebuild it", label_format)
        added = []
        if not dry_run and (shard is None or shard.main):  # one writer adds the rules it lacks
            with locks.held(path, f"the cache {path}"):
                added = rule_store.add_to(path)
        report.status, report.size_bytes = "up to date", path.stat().st_size
        report.notes.append("the cache is complete with these settings; --force rebuilds it")
        report.notes += [f"added observation rules {', '.join(added)} to the cache"] if added else []
        return _reported(report, shard)
    shards.refuse_other_layouts(path, shard, force)
    resume = partial_file.exists() and not force
    if resume:
        refuse_other_settings(partial_file, settings, own, "was started", "start over", label_format)
    if dry_run:
        if images.skipped and not skip_missing:
            report.notes.append(f"{len(images.skipped)} image files are missing: a real run needs --skip-missing")
        report.notes.append(f"would {'resume' if resume else 'write'} {partial_file} and rename it to {path.name}")
        return _reported(report, shard)

    trunk = backbones.build(described)  # before creating anything: weights are the likeliest thing to be missing
    require_writable(path.parent)
    with locks.held(writing, f"the cache {writing}"):  # one writer: a second `extract --force` would swap its file in
        if resume and not partial_file.exists():
            raise SpmlError(f"{path} was finished by another process meanwhile: run the command again")
        # before the first write: h5py has crashed outright creating a file on a full disk
        room = estimated_size(own, len(images.classes), described.row_width, label_format)
        room *= 2 if shard and shard.main else 1  # rank 0 joins
        require_room(path, room - (partial_file.stat().st_size if resume else 0))
        trunk = trunk.eval().requires_grad_(False).to(torch_device, memory_format=torch.channels_last)
        text = _text_side(trunk, images.classes, templates)
        if torch_device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # worth it: batches are padded to one input shape for the whole run
        if resume:
            partial = cache.PartialCache.open(writing)
        else:
            partial_file.unlink(missing_ok=True)
            partial = cache.PartialCache.create(writing, settings, own, described.row_shapes(), text, label_format)
        try:
            report.resumed, bad_before = partial.num_done(), partial.num_bad()
            paths = {name: [images.path(image_id) for image_id in own[name].ids] for name in cache.SPLITS}
            computing = time.perf_counter()
            try:
                report.extracted, left_out = run_batches(
                    partial, paths, trunk, preprocess=described.preprocess, width=described.row_width,
                    batch_size=batch_size, device=torch_device,
                    workers=default_workers(torch_device) if workers is None else workers, precision=precision,
                    skip_bad=on_bad_image == "skip", label=f"extract {images.dataset}", pad_batches=pad_batches,
                    feed_thread=feed_thread,
                )  # fmt: skip
            except KeyboardInterrupt:
                if shard and not shard.main:
                    raise SystemExit(130) from None  # rank 0 says what was kept
                total = sum(len(split) for split in own.values())
                kept = f"{partial.num_done()} of {total} images are kept in {partial_file}"
                raise Interrupted(kept + (" (and the other ranks' in theirs)" if shard else ""),
                                  shard.command() if shard else None) from None
            report.seconds = time.perf_counter() - computing
            report.left_out = partial.num_bad() - bad_before
            report.recomputed = partial.recomputed()
            if shard is None:
                final, report.skipped = partial.finalise(run_attrs(torch_device, described.family),
                                                         rule_store.for_finalise(rows))
        except (OSError, RuntimeError) as err:
            if DiskFull.caused(err):  # h5py's own words for it are two lines of HDF5 internals
                raise DiskFull(partial_file) from None
            raise
        finally:
            partial.close()
    if shard:
        done = {"extracted": report.extracted, "left_out": report.left_out, "resumed": report.resumed,
                "seconds": report.seconds, "not_finite": left_out}
        with locks.held(path, f"the cache {path}") if shard.main else nullcontext():
            joined = shards.join(shard, path, settings, rows, described.row_shapes(),
                                 run_attrs(torch_device, described.family), done, rule_store.for_finalise(rows), text,
                                 label_format)
        shard.ranks.leave()
        if joined is None:
            return None  # rank 0 reports for every rank
        final, report.skipped, report.recomputed, totals = joined
        report.extracted, report.left_out, report.resumed, report.seconds, left_out = (
            totals[key] for key in ("extracted", "left_out", "resumed", "seconds", "not_finite"))
    report.status, report.size_bytes = "written", final.stat().st_size
    report.counts = {name: counts[name] - len(report.skipped[name]) for name in cache.SPLITS}
    report.notes += writer.notes(report.recomputed, left_out, precision)
    if rule_store.rules:
        report.notes.append(f"stored observation rules {', '.join(r.text for r in rule_store.rules)} beside single")
    return report
