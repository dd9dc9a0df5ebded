"""The processes of one command under `torchrun` (one node or many): which one this is, and the few Python values
they exchange. The one place torchrun's state is read, for every stage. Stages one and two talk over gloo, which
works between CPU and GPU processes alike: they exchange rows' results and barriers, never tensors in a training
step; stage three's data parallelism joins over nccl on GPUs (finetune/parallel.py).
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spml_cache.runtime.errors import Interrupted, check_stop, stop_exit_code


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
    owns_group: bool = True  # this command joined the process group, so it leaves it (a caller's group stays)

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
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def current(backend: str = "gloo") -> Ranks | None:
    """This process's place under torchrun, None when it runs alone. Joins the process group over `backend`
    unless the caller has joined one already (then that group is used, and left to the caller); over nccl, on
    this process's own GPU, chosen before joining so that nccl's communicators are made there. A stop while the
    processes join (Ctrl-C, or torchrun's SIGTERM after another process ended before it joined) is `Interrupted`
    on rank 0 and a quiet exit on the others, within `JOIN_POLL_S`."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local)
    owns_group = not dist.is_initialized()
    if owns_group:
        try:
            _join(backend, local)
        except KeyboardInterrupt:
            if int(os.environ.get("RANK", "0")) != 0:
                raise SystemExit(stop_exit_code()) from None  # rank 0 says it
            raise Interrupted(f"nothing was done: the {os.environ['WORLD_SIZE']} processes of this torchrun command"
                              " were still joining (another one ended, or a stop was asked for)",
                              launcher_command()) from None
    return Ranks(dist.get_rank(), dist.get_world_size(), local, owns_group)


# How often the main thread looks at a stop while the processes join.
JOIN_POLL_S = 0.2


def _join(backend: str, local: int) -> None:
    """`init_process_group` in a thread of its own while the main thread waits for it, ready to stop. The join
    blocks in C++ (the rendezvous through torchrun's store, gloo's handshake) where Python's signal handlers never
    run: a process whose peer died before joining sat deaf to torchrun's SIGTERM until its SIGKILL 30 s later.
    The thread is a daemon: a process that stops leaves it blocked, and exits all the same."""
    failed: list[BaseException] = []

    def join() -> None:
        try:
            if backend == "nccl":
                torch.cuda.set_device(local)  # the current device is the thread's own
            dist.init_process_group(backend)
        except BaseException as err:  # raised again in the main thread
            failed.append(err)

    thread = threading.Thread(target=join, name="spml-cache join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(JOIN_POLL_S)  # a signal's handler runs here (and raises KeyboardInterrupt where not deferred)
        check_stop()  # a stop the handler only recorded (`stops_deferred`)
    if failed:
        raise failed[0]


def launcher_command() -> str:
    """The torchrun command that goes on: this one's processes per node (and nodes), this command's arguments."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // max(per_node, 1)
    return shlex.join(["torchrun", *(["--nnodes", str(nodes)] if nodes > 1 else []), "--nproc-per-node",
                       str(per_node), "-m", "spml_cache", *sys.argv[1:]])
