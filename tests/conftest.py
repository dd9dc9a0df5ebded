"""Shared test setup: small, deterministic; tests marked `cuda` run only where a CUDA GPU is visible."""

import pytest
import torch

torch.set_num_threads(2)


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
