"""Memory budgets: `--memory-budget SIZE` parsed, the default from the device's free memory, and the process's
peak resident memory (what a budget is measured against)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import resource
from pathlib import Path

from spml_cache.runtime.errors import SpmlError

FLAG = "--memory-budget"
DEFAULT_SHARE = 0.8  # of the device's free memory, when no budget is given
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_size(text: str | int | None, flag: str = FLAG) -> int | None:
    """"1GB", "512M", "1.5GiB", "2000000" (bytes) -> bytes; None stays None (the default applies). Units are
    powers of two (1GB = 2^30 bytes)."""
    if text is None or isinstance(text, int):
        if isinstance(text, int) and text <= 0:
            raise SpmlError(f"{flag} {text}: give a positive size such as 1GB or 512MB")
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise SpmlError(f"{flag} {text!r}: give a positive size such as 1GB, 512MB or 2000000 (bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


def free_memory(device) -> int:
    """Bytes free now: a GPU's (`torch.cuda.mem_get_info`), else the machine's available RAM."""
    if device.type == "cuda":
        import torch  # here: the command line parses sizes before the heavy imports

        return int(torch.cuda.mem_get_info(device)[0])
    return _available_ram()


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def room_left() -> int:
    """Bytes this process may still allocate in RAM: the machine's available memory, or less where a limit is set
    on the process (an address-space rlimit: `ulimit -v`, `prlimit`) or on its cgroup (`memory.max`: a container's,
    a scheduler's job)."""
    room = _available_ram()
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        room = min(room, limit - _mapped())
    for limit_file, usage_file in _cgroup_files():
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit():  # cgroup v2 writes "max" for none
            room = min(room, int(limit) - int(usage))
    return max(room, 0)


def _mapped() -> int:
    """This process's mapped address space now, bytes (what an address-space rlimit counts)."""
    return _statm(0)


def _cgroup_files() -> list[tuple[str, str]]:
    """(limit, usage) files of this process's memory cgroup: v2's unified hierarchy, else v1's memory controller."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found.append((f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current"))
        elif "memory" in controllers.split(","):
            found.append((f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                          f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"))
    return found


def budget(given: str | int | None, device) -> int:
    """`--memory-budget`, else `DEFAULT_SHARE` of the device's free memory in whole MB (a size `flag_text` writes
    as the flag takes it)."""
    parsed = parse_size(given)
    return parsed if parsed is not None else int(DEFAULT_SHARE * free_memory(device)) // 2**20 * 2**20


def flag_text(size: int) -> str:
    """Bytes as `--memory-budget` reads them back exactly: "650MB", "1GB", else the bytes ("1536000")."""
    for unit, scale in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def resident() -> int:
    """This process's resident memory now, bytes (0 where /proc is missing)."""
    return _statm(1)


def _statm(field: int) -> int:
    """Field `field` of /proc/self/statm (0: the mapped size, 1: the resident one) in bytes; 0 where it is missing."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[field]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_resident() -> int:
    """This process's peak resident memory so far, bytes (`ru_maxrss`, KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
LARGE_ALLOCATION = 1 << 20  # bytes: under a memory budget, blocks from this size are mapped alone (`keep_within`)


def _glibc(function: str):
    """A glibc allocator function, or None (musl and macOS have neither malloc_trim nor these mallopt knobs)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None


def give_back_freed() -> None:
    """Return the C heap's freed memory to the system now (glibc's `malloc_trim`; elsewhere nothing). What a job
    frees stays in the allocator's arenas otherwise, and a run that trains its lr groups in turn would grow by
    some of it with every group (measured: ~45 MB a group at 5,000 classes, docs/benchmarks.md)."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


def keep_within() -> None:
    """For a run under a memory budget: every block of `LARGE_ALLOCATION` bytes or more gets its own mapping,
    returned to the system when freed, and freed heap is trimmed early. glibc otherwise raises its mapping
    threshold as large blocks are freed (up to 32 MB), after which scoring's and training's transient buffers
    come from arenas that keep what they grew to: measured ~70-170 MB above the steady state at the end of a
    500k x 5,000 epoch (docs/benchmarks.md). Costs a mapping per large allocation; elsewhere a no-op."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION)  # fixed: glibc no longer adjusts it
        mallopt(_M_TRIM_THRESHOLD, LARGE_ALLOCATION)


def describe(size: int) -> str:
    """Bytes as '1.2 GB' (powers of two)."""
    for unit, scale in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
