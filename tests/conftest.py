"""Shared test setup: small, deterministic; tests marked `cuda` run only where a CUDA GPU is visible."""

import os

import pytest
import torch

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
