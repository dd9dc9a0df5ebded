"""Stage one across processes: `torchrun --nproc-per-node N [--nnodes M ...] -m spml_cache extract ...`.

Every rank reads the dataset and draws the protocol itself (deterministic, so all draw the same rows), then
extracts rows r, r + N, r + 2N, ... of each split into a partial file of its own, `<cache>.shard-r-of-N.partial`,
resumable like any partial file. After every rank is done, rank 0 copies the shards into the one cache (a copy,
not an HDF5 virtual dataset over the shard files: the cache stays one self-contained file that moves, verifies
and loads like any other, at the cost of twice its size on the disk while the copy runs) and removes them.
Resuming with another N is refused in one line naming the N to use. Processes talk over gloo (barriers and a few
numbers, ranks.py): the features never travel between them.
"""

from __future__ import annotations

import shlex
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spml_cache import cache
from spml_cache.cache.csr import DEFAULT_FORMAT
from spml_cache.labels import take
from spml_cache.runtime import locks
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.ranks import Ranks, current as current_ranks


@dataclass(frozen=True)
class Shard:
    """This process's share of an extraction under torchrun: every `world`-th row of each split from `rank`."""

    ranks: Ranks

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world(self) -> int:
        return self.ranks.world

    @property
    def main(self) -> bool:
        return self.ranks.main

    def rows(self, rows: dict[str, cache.SplitRows]) -> dict[str, cache.SplitRows]:
        """This rank's rows of each split; sparse label matrices stay sparse (`take`)."""
        def mine(matrix, count: int):
            return take(matrix, np.arange(self.rank, count, self.world))

        return {name: cache.SplitRows(split.ids[self.rank :: self.world], mine(split.labels, len(split)),
                                      mine(split.observed, len(split)), mine(split.label_mask, len(split)))
                for name, split in rows.items()}

    def path(self, final: Path, rank: int | None = None) -> Path:
        """The cache file rank `rank` (default: this one) writes; its partial file is `<this>.partial`."""
        return final.with_name(f"{final.name}.shard-{self.rank if rank is None else rank}-of-{self.world}")

    def device(self, device: torch.device) -> torch.device:
        return self.ranks.device(device)

    def command(self) -> str:
        """The command that goes on: the same torchrun command (the shards need the same number of processes)."""
        return shlex.join(["torchrun", "--nproc-per-node", str(self.world), "-m", "spml_cache", *sys.argv[1:]])


def current() -> Shard | None:
    """This process's shard under torchrun, None in a single process."""
    ranks = current_ranks()
    return Shard(ranks) if ranks else None


def refuse_other_layouts(final: Path, shard: Shard | None, force: bool) -> None:
    """Shard files of an extraction over another number of processes: removed with --force, else refused."""
    mine = {cache.partial_path(shard.path(final, rank)) for rank in range(shard.world)} if shard else set()
    others = [path for path in final.parent.glob(f"{final.name}.shard-*-of-*.partial") if path not in mine]
    if not others:
        return
    if force:
        if shard is None or shard.main:
            with ExitStack() as held:  # every lock first: a running extraction's files are never removed
                held.enter_context(locks.held(final, f"the cache {final}"))  # rank 0 holds it while it joins
                for path in others:
                    writer = path.with_name(path.name.removesuffix(".partial"))  # the name its rank locks
                    held.enter_context(locks.held(writer, f"the cache shard {writer}"))
                for path in others:
                    path.unlink(missing_ok=True)
        return
    world = others[0].name.rsplit("-of-", 1)[1].split(".")[0]
    now = f"{shard.world} processes" if shard else "one process"
    raise SpmlError(f"{final} was started by an extraction over {world} processes (its shard files are beside it),"
                    f" not {now}: go on with torchrun --nproc-per-node {world} -m spml_cache extract ..., or pass"
                    " --force to start over")


@dataclass(frozen=True, kw_only=True)
class Joined:
    """What the joined cache is made of, as `PartialCache.create` takes it: its settings attrs, every row, the
    trunk output's row shapes (a CLIP cache's embeddings travel with the features), its text side and the label
    matrices' storage; and what `PartialCache.finalise` stores: the run's attrs and the rules' masks."""

    settings: dict
    rows: dict[str, cache.SplitRows]
    feature_dim: object
    attrs: dict
    rule_masks: object = None
    text: dict | None = None
    labels: str = DEFAULT_FORMAT


def join(shard: Shard, final: Path, joined: Joined, done: dict) -> tuple[Path, dict, dict, dict] | None:
    """Once every rank is done: rank 0 copies the shards into the cache `final` and removes them. `done` is this
    rank's {extracted, left_out, resumed, seconds}; returns (cache path, ids dropped per split, rows
    recomputed in fp32 per split, the totals of every rank) on rank 0, None on the others."""
    settings, rows, feature_dim, attrs = joined.settings, joined.rows, joined.feature_dim, joined.attrs
    rule_masks, text, labels = joined.rule_masks, joined.text, joined.labels
    every = shard.ranks.gather(done)  # also the barrier: every shard is complete and closed
    if not shard.main:
        return None
    totals = {key: sum(part[key] for part in every) for key in ("extracted", "left_out", "resumed")}
    totals["seconds"] = max(part["seconds"] for part in every)  # they ran side by side
    shards = [cache.PartialCache.open(shard.path(final, rank)) for rank in range(shard.world)]
    try:
        full = cache.PartialCache.create(final, settings, rows, feature_dim, text, labels)
        try:
            full.join_shards(shards)
            recomputed = full.recomputed()
            path, dropped = full.finalise(attrs, rule_masks)
        finally:
            full.close()
    finally:
        for part in shards:
            part.close()
    for part in shards:
        cache.partial_path(part.final).unlink(missing_ok=True)
    return path, dropped, recomputed, totals

