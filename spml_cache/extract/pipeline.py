"""Stage one: run a frozen backbone (backbones/: ResNet-50 by default) over a dataset once and write the HDF5
feature cache; for a CLIP backbone also its normalised image embeddings and the class prompts' text embeddings.

`extract` reads the dataset, applies the protocol to the *full* dataset, fills `<out>.partial` batch by batch
and renames it to `<out>` when every row is done; re-running resumes from the partial file, and a complete
cache with the same settings is left alone unless `force`.

On a GPU, loader workers only read file bytes; a background thread (feed.py) decodes each batch with nvjpeg,
resizes and normalises it on a CUDA stream of its own while the main thread runs the trunk on the previous one
under fp16/bf16 autocast in channels_last (with `decode="cpu"` the workers decode and resize as on the CPU,
giving the CPU's pixels, and the thread copies each batch to the GPU and normalises it there); features come back
through a ring of pinned buffers one batch behind, so the copy and the HDF5 write overlap the next batch. Every
batch the trunk sees is padded to the run's one batch size (a split's last batch, a batch with bad images), so
cuDNN's autotuning (`benchmark`) runs once, not once per new shape; the padding rows are dropped before anything
is checked or written. On the CPU, workers decode and resize, and nothing is padded (the model is the bottleneck
there, and padding is compute).

A corrupt or truncated image stops the run naming the file (`on_bad_image="fail"`), or (`"skip"`) is flagged
in the partial file and its row dropped when the cache is finalised, its id listed in the `skipped_images`
attr: no row ever carries features of an image that was not decoded. No row carries a non-finite feature
either (writer.py): rows non-finite in fp16/bf16 are recomputed in fp32 and counted in `recomputed_fp32`;
a row non-finite even in fp32 is the backbone's fault (its weights or its code), never an image's: an error
naming the backbone, whatever `on_bad_image` says. A backbone that raises, or changes its output's width, mid-run
is one line naming it too, the rows done kept in the partial file. A cache with a split whose every image was
left out is never sealed.
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
from spml_cache.extract import recheck, shards, writer
from spml_cache.extract.batches import BatchRun, run_batches
from spml_cache.runtime import locks
from spml_cache.extract.plan import (
    backbone_code_change, estimated_size, output_path, plan_rows, refuse_foreign_file, refuse_other_settings,
    require_writable, settings_attrs,
)
from spml_cache.cache.csr import resolve_format
from spml_cache.extract.rules import RuleStore
from spml_cache.images import decoder_version, resolve_decode
from spml_cache.runtime.devices import default_workers, resolve_device
from spml_cache.runtime.disk import require_room
from spml_cache.options.declared import from_keywords
from spml_cache.options.extract import ExtractOptions, ExtractPlacement
from spml_cache.runtime.errors import DiskFull, Interrupted, SpmlError, finished

@dataclass(kw_only=True)
class ExtractReport:
    """What `extract` did (`sc.extract` returns it; the command line prints it): `path`, the cache; `status`,
    written, up to date or dry run; `counts`, rows per split; `extracted` (rows computed now), `left_out`
    (undecodable images), `resumed` (rows a partial file already held), `skipped`, `recomputed`, `missing`; how it
    ran (`precision`, `decoder`, `device`, `seconds`, `images_per_s`), `size_bytes`, `notes`."""

    path: Path
    status: str  # "written", "up to date" or "dry run"
    counts: dict[str, int]  # rows per split of the cache (planned, for a dry run)
    extracted: int = 0  # rows computed by this run
    left_out: int = 0  # of them, rows flagged bad (undecodable images): not in the cache
    resumed: int = 0  # rows found already done in the partial file
    skipped: dict[str, list[str]] = field(default_factory=dict)  # undecodable images dropped, per split
    recomputed: dict[str, int] = field(default_factory=dict)  # rows recomputed in fp32 after non-finite fp16/bf16 features
    precision: str = ""  # what the trunk ran in: fp32, fp16 or bf16
    decoder: str = ""  # what decoded the JPEGs: nvjpeg or libjpeg-turbo
    missing: list[str] = field(default_factory=list)  # image files missing on disk (reader's skip_missing)
    seconds: float = 0.0
    device: str = ""
    size_bytes: int = 0  # the cache file's size (estimated for a dry run)
    notes: list[str] = field(default_factory=list)

    @property
    def images_per_s(self) -> float:
        """Rows computed per second by this run."""
        return self.extracted / self.seconds if self.seconds > 0 else 0.0


# --- provenance ------------------------------------------------------------------------------------------


def run_attrs(device: torch.device, family: str = "tv", decode: str | None = None) -> dict:
    """Provenance of the process that finished the cache (and the version of the backbone's library, and of the
    JPEG decoder that `decode` names)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    library = backbones.FAMILIES.get(family).library
    versions = {f"{library}_version": importlib.import_module(library).__version__} if library else {}
    versions |= {"decoder_version": decoder_version(decode)} if decode else {}
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


def extract(dataset: str, root: Path, **keywords) -> ExtractReport | None:
    """`run_extract` by keywords, for the Python API: each a field of `ExtractOptions` (what the cache holds) or of
    `ExtractPlacement` (where and how it is computed), e.g. `extract("voc", root, weights="none", device="cpu")`."""
    return run_extract(*from_keywords({"dataset": dataset, "root": root, **keywords}, ExtractOptions,
                                      ExtractPlacement))


def run_extract(options: ExtractOptions, placement: ExtractPlacement) -> ExtractReport | None:
    """Stage one's door (`spml-cache extract`): build (or resume, or confirm) the feature cache the options describe;
    see the module docstring. A complete cache with these settings only gains the observation rules it lacks. Under
    torchrun every process extracts its share of the rows and rank 0 joins them (shards.py); the other ranks return
    None, rank 0 the whole's report."""
    if placement.root is None:
        raise SpmlError("no data root: pass --root DIR or set SPML_DATA")
    plan = _plan(options, placement)
    refuse_foreign_file(plan.path)
    if plan.path.exists() and not placement.force:
        return _reported(_up_to_date(plan), plan.shard)
    shards.refuse_other_layouts(plan.path, plan.shard, placement.force)
    resume, code_changed = plan.resume, None
    if resume:  # a plugin backbone's code may have changed (fixed after it failed): checked on the rows kept
        refuse_other_settings(plan.partial_file, plan.settings, plan.own, "was started", "start over",
                              plan.label_format, but=("backbone_origin",))
        code_changed = backbone_code_change(plan.partial_file, plan.settings)
    if placement.dry_run:
        return _reported(_dry_run(plan), plan.shard)
    trunk = backbones.build(plan.described)  # before creating anything: weights are the likeliest thing to be missing
    require_writable(plan.path.parent)
    with locks.held(plan.writing, f"the cache {plan.writing}"):  # one writer: a second `--force` would swap its file
        partial, text = _open(plan, trunk, resume)
        try:
            if code_changed is not None:
                plan.report.notes.append(recheck.keep_or_refuse(partial, _paths(plan), trunk, _batch_run(plan),
                                                                code_changed))
                partial.file.attrs["backbone_origin"] = plan.settings["backbone_origin"]  # what goes on now
            _run(plan, partial, trunk)
            final = None if plan.shard else _seal(plan, partial)
        except (OSError, RuntimeError) as err:
            if DiskFull.caused(err):  # h5py's own words for it are two lines of HDF5 internals
                raise DiskFull(plan.partial_file) from None
            raise
        finally:
            partial.close()
    if plan.shard:
        final = _join(plan, text)
        if final is None:
            finished()  # its shard is joined
            return None  # rank 0 reports for every rank
    finished()  # the cache is sealed: a stop now has nothing to stop
    return _written(plan, final)


@dataclass(kw_only=True)
class _Plan:
    """What one extraction will do, known before any image is read."""

    options: ExtractOptions
    placement: ExtractPlacement
    shard: shards.Shard | None  # under torchrun: this process's share of the rows
    device: torch.device
    precision: str
    decode: str  # gpu (nvjpeg) or cpu (libjpeg-turbo in the loader workers)
    images: datasets.LabeledImages
    rows: dict  # every row of the cache, per split (cache.SplitRows)
    own: dict  # the rows this process computes
    described: backbones.Description
    templates: list[str] | None  # a CLIP backbone's prompt templates
    settings: dict  # the cache's settings attrs
    path: Path  # the cache
    writing: Path  # the file this process writes: the cache, or its shard under torchrun
    label_format: str  # dense or sparse
    rule_store: RuleStore
    report: ExtractReport

    @property
    def partial_file(self) -> Path:
        return cache.partial_path(self.writing)

    @property
    def resume(self) -> bool:
        return self.partial_file.exists() and not self.placement.force


def _plan(options: ExtractOptions, placement: ExtractPlacement) -> _Plan:
    """Read the dataset (a dry run lists missing files instead of stopping on them), apply the protocol, describe
    the backbone and the cache: everything decided before any work."""
    shard = shards.current()
    device = shard.device(resolve_device(placement.device)) if shard else resolve_device(placement.device)
    precision = options.precision if options.precision != "auto" else "fp16" if device.type == "cuda" else "fp32"
    decode = resolve_decode(options.decode, device)
    images = datasets.read(options.dataset, placement.root, skip_missing=options.skip_missing or placement.dry_run)
    protocol_result = protocol.apply_protocol(images)
    limit = options.limit or 0
    rows = plan_rows(protocol_result, limit)
    label_format = resolve_format(options.labels, len(images.classes))
    described = backbones.describe(options.backbone, options.weights, options.resolution, options.clip_features,
                                   options.crops, options.features)
    templates = backbones.prompts(options.prompts) if described.embed_dim else None
    settings = settings_attrs(images, protocol_result.attrs, described, precision, limit, templates,
                              decode=decode)
    path = output_path(placement.out, images.dataset, described.resolution, described.slug)
    report = ExtractReport(path=path, status="dry run", counts={name: len(split) for name, split in rows.items()},
                           missing=list(images.skipped), device=str(device), precision=precision,
                           decoder=settings["decoder"], notes=list(images.notes),
                           size_bytes=estimated_size(rows, len(images.classes), described.row_width, label_format))
    return _Plan(options=options, placement=placement, shard=shard, device=device, precision=precision, decode=decode,
                 images=images, rows=rows, own=shard.rows(rows) if shard else rows, described=described,
                 templates=templates, settings=settings, path=path, writing=shard.path(path) if shard else path,
                 label_format=label_format, rule_store=RuleStore(list(options.observe or []) or None, images, settings),
                 report=report)


def _up_to_date(plan: _Plan) -> ExtractReport:
    """A complete cache with these settings: left alone, but for the observation rules it lacks."""
    refuse_other_settings(plan.path, plan.settings, plan.rows, "was built", "rebuild it", plan.label_format)
    added = []
    if not plan.placement.dry_run and (plan.shard is None or plan.shard.main):  # one writer adds the rules it lacks
        with locks.held(plan.path, f"the cache {plan.path}"):
            added = plan.rule_store.add_to(plan.path)
    report = plan.report
    report.status, report.size_bytes = "up to date", plan.path.stat().st_size
    report.notes.append("the cache is complete with these settings; --force rebuilds it")
    report.notes += [f"added observation rules {', '.join(added)} to the cache"] if added else []
    return report


def _dry_run(plan: _Plan) -> ExtractReport:
    report = plan.report
    if plan.images.skipped and not plan.options.skip_missing:
        report.notes.append(f"{len(plan.images.skipped)} image files are missing: a real run needs --skip-missing")
    report.notes.append(f"would {'resume' if plan.resume else 'write'} {plan.partial_file} and rename it to"
                        f" {plan.path.name}")
    return report


def _open(plan: _Plan, trunk, resume: bool):
    """The partial file to fill (resumed, or created once the disk has room for it) and, for a CLIP backbone, the
    class prompts' text embeddings; the trunk readied on the device (in place)."""
    if resume and not plan.partial_file.exists():
        raise SpmlError(f"{plan.path} was finished by another process meanwhile: run the command again")
    # before the first write: h5py has crashed outright creating a file on a full disk
    room = estimated_size(plan.own, len(plan.images.classes), plan.described.row_width, plan.label_format)
    room *= 2 if plan.shard and plan.shard.main else 1  # rank 0 joins
    require_room(plan.path, room - (plan.partial_file.stat().st_size if resume else 0))
    trunk.eval().requires_grad_(False).to(plan.device, memory_format=torch.channels_last)
    text = _text_side(trunk, plan.images.classes, plan.templates)
    if plan.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # worth it: batches are padded to one input shape for the whole run
    if resume:
        return cache.PartialCache.open(plan.writing), text
    plan.partial_file.unlink(missing_ok=True)
    return cache.PartialCache.create(plan.writing, plan.settings, plan.own, plan.described.row_shapes(), text,
                                     plan.label_format), text


def _run(plan: _Plan, partial, trunk) -> None:
    """Every row this process has not done yet, batch by batch, into the partial file; the report counts them.
    Ctrl-C keeps what is done and says how to go on."""
    report, shard = plan.report, plan.shard
    report.resumed, bad_before = partial.num_done(), partial.num_bad()
    computing = time.perf_counter()
    try:
        report.extracted = run_batches(partial, _paths(plan), trunk, _batch_run(plan))
    except KeyboardInterrupt:
        if shard and not shard.main:
            raise SystemExit(130) from None  # rank 0 says what was kept
        total = sum(len(split) for split in plan.own.values())
        kept = f"{partial.num_done()} of {total} images are kept in {plan.partial_file}"
        raise Interrupted(kept + (" (and the other ranks' in theirs)" if shard else ""),
                          shard.command() if shard else None) from None
    report.seconds = time.perf_counter() - computing
    report.left_out = partial.num_bad() - bad_before
    report.recomputed = partial.recomputed()


def _paths(plan: _Plan) -> dict[str, list[Path]]:
    """The image file of each row this process computes, per split."""
    return {name: [plan.images.path(image_id) for image_id in plan.own[name].ids] for name in cache.SPLITS}


def _batch_run(plan: _Plan) -> BatchRun:
    placement = plan.placement
    return BatchRun(
        preprocess=plan.described.preprocess, width=plan.described.row_width, batch_size=placement.batch_size,
        workers=default_workers(plan.device) if placement.workers is None else placement.workers,
        device=plan.device, precision=plan.precision, skip_bad=plan.options.on_bad_image == "skip",
        label=f"extract {plan.images.dataset}", backbone=plan.described.backbone,
        pad_batches=placement.pad_batches, feed_thread=placement.feed_thread, decode=plan.decode)


def _seal(plan: _Plan, partial) -> Path:
    """One process: the partial file becomes the cache (bad rows dropped, rules' masks stored, renamed)."""
    final, plan.report.skipped = partial.finalise(run_attrs(plan.device, plan.described.family, plan.decode),
                                                  plan.rule_store.for_finalise(plan.rows))
    return final


def _join(plan: _Plan, text) -> Path | None:
    """Under torchrun: rank 0 joins every rank's shard into the cache (and the report of the whole); None on the
    other ranks."""
    shard, report = plan.shard, plan.report
    done = {"extracted": report.extracted, "left_out": report.left_out, "resumed": report.resumed,
            "seconds": report.seconds}
    with locks.held(plan.path, f"the cache {plan.path}") if shard.main else nullcontext():
        joined = shards.join(shard, plan.path, shards.Joined(
            settings=plan.settings, rows=plan.rows, feature_dim=plan.described.row_shapes(),
            attrs=run_attrs(plan.device, plan.described.family, plan.decode),
            rule_masks=plan.rule_store.for_finalise(plan.rows), text=text, labels=plan.label_format), done)
    shard.ranks.leave()
    if joined is None:
        return None
    final, report.skipped, report.recomputed, totals = joined
    report.extracted, report.left_out, report.resumed, report.seconds = (
        totals[key] for key in ("extracted", "left_out", "resumed", "seconds"))
    return final


def _written(plan: _Plan, final: Path) -> ExtractReport:
    report = plan.report
    report.status, report.size_bytes = "written", final.stat().st_size
    report.counts = {name: report.counts[name] - len(report.skipped[name]) for name in cache.SPLITS}
    report.notes += writer.notes(report.recomputed, plan.precision)
    if plan.rule_store.rules:
        report.notes.append(f"stored observation rules {', '.join(r.text for r in plan.rule_store.rules)} beside"
                            " single")
    return report
