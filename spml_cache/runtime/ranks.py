"""The processes of one command under `torchrun` (one node or many): which one this is, and the few Python values
they exchange. They talk over gloo, which works between CPU and GPU processes alike: stage one and stage two
exchange rows' results and barriers, never tensors in a training step (stage three's data parallelism has its own
process group, finetune/parallel.py).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PeerLost(Exception):
    """Another process of the command ended (killed, stopped, or failed) while this one exchanged values with it:
    gloo's own error, which names sockets, not what happened."""


@contextmanager
def _peers_watched():
    try:
        yield
    except RuntimeError as err:  # gloo: "Connection closed by peer", "Socket Timeout", ...
        raise PeerLost(str(err).splitlines()[0] if str(err) else type(err).__name__) from err


@dataclass(frozen=True)
class Ranks:
    """This process: `rank` of `world`, `local` on its node (torchrun's RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int
    world: int
    local: int

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """On GPUs, this process's own (its local rank); on the CPU, the CPU."""
        return torch.device("cuda", self.local) if device.type == "cuda" else device

    def share(self, items: list) -> list:
        """This process's share of a list every process has in the same order: every `world`-th from `rank`."""
        return items[self.rank :: self.world]

    def broadcast(self, value):
        """Rank 0's `value`, on every process."""
        box = [value]
        with _peers_watched():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value) -> list | None:
        """Every process's `value`, in rank order, on rank 0 (None on the others); also a barrier."""
        every = [None] * self.world if self.main else None
        with _peers_watched():
            dist.gather_object(value, every, dst=0)
        return every

    def leave(self) -> None:
        """Leave the process group once this process has nothing more to exchange: gloo's threads must end
        before the interpreter does (an exit with them running aborts the process)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def current() -> Ranks | None:
    """This process's place under torchrun (joining the process group), None when it runs alone."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
