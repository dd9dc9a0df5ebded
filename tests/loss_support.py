"""Scalar restatements of the spec's notation (docs/losses.md) for hand-worked loss values: plain math, no torch."""

import math


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def nl(q):
    """nl(q) = -log(q)."""
    return -math.log(q)


def entropy(p):
    """H(p) = -p log p - (1 - p) log(1 - p)."""
    return -p * math.log(p) - (1 - p) * math.log(1 - p)
