"""Shared test setup: small, deterministic; tests marked `cuda` run only where a CUDA GPU is visible."""

import pytest
import torch

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
