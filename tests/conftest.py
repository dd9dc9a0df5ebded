"""Shared test setup: small, deterministic; tests marked `cuda` run only where a CUDA GPU is visible, tests marked
`realdata` only where the real photos and weights are (realdata_support.py)."""

import os

import pytest
import torch
from realdata_support import RealData, skip_reason

# Under pytest-xdist (`-n auto`, pyproject.toml) each worker gets its share of the cores, and so do the command
# lines it starts: two workers of two threads each on two cores make every small op wait for a busy core (the
# engine's tests ran 5x slower so).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
torch.set_num_threads(THREADS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the tests of a module that asks for it (the fine-tuning modules)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def realdata(tmp_path_factory) -> RealData:
    """The real-photo tier's products, built once for the whole session: in the folder every pytest-xdist worker
    of this run shares (the parent of each worker's own temporary folder)."""
    base = tmp_path_factory.getbasetemp()
    return RealData((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "realdata")


def pytest_collection_modifyitems(config, items):
    no_realdata = skip_reason()
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU visible"))
        # the marker itself: "realdata" in item.keywords holds for every test (the fixture's name is a keyword of all)
        if no_realdata and item.get_closest_marker("realdata"):
            item.add_marker(pytest.mark.skip(reason=no_realdata))
