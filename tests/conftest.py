"""Shared test setup: small, CPU-only, deterministic."""

import torch

torch.set_num_threads(2)
