"""Observation rules' masks in a cache (rules besides `single`, whose masks are `/{split}/observed`): stored under
`/{train,val}/observed_rules/<rule text>` in the form of the split's labels (dense int8, or CSR beside CSR labels),
added to a complete cache atomically, and read back checked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py
import numpy as np

from spml_cache.cache.csr import read, store, stored_shape, stored_sparse
from spml_cache.cache.schema import OBSERVED_SPLITS, RULES_GROUP
from spml_cache.labels import is_sparse
from spml_cache.runtime.errors import SpmlError

# {rule text: (train mask, val mask)}: observation rules besides `single`, each int8 [N, C] (or SparseLabels) per split
RuleMasks = dict[str, tuple[np.ndarray, np.ndarray]]


def write_rules(file: h5py.File, masks: RuleMasks) -> None:
    """Each rule's train and val masks under /{split}/observed_rules/<rule text> (a rule there is replaced), in the
    form of the split's labels: dense, or CSR beside CSR labels."""
    for rule, pair in masks.items():
        for split, mask in zip(OBSERVED_SPLITS, pair):
            labels = stored_shape(file[split]["labels"])
            if tuple(mask.shape) != labels:
                raise SpmlError(f"{split}: the {rule} mask has shape {mask.shape}, labels {labels}")
            group = file[split].require_group(RULES_GROUP)
            if rule in group:
                del group[rule]
            store(group, rule, mask, stored_sparse(file[split]["labels"]), np.int8)


def add_rules(path: Path | str, masks: RuleMasks) -> Path:
    """Store more rules' masks in the complete cache at `path`: a copy gets them and replaces it, so that a
    reader never sees a cache with half its masks (the features are copied, not recomputed)."""
    path = Path(path)
    temporary = path.with_name(path.name + ".rules.partial")
    try:
        shutil.copyfile(path, temporary)
        with h5py.File(temporary, "r+") as file:
            write_rules(file, masks)
        os.replace(temporary, path)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise SpmlError(f"cannot add observation rules to {path} ({err.strerror or err})") from None
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def read_rules(path: Path, name: str, group: h5py.Group, shape: tuple) -> dict:
    """The split's masks of other observation rules, checked like `observed` (values -1, 0 and 1, the labels'
    shape)."""
    rules = {}
    for rule, node in (group[RULES_GROUP].items() if RULES_GROUP in group else ()):
        mask = read(node, np.int8)  # CSR beside CSR labels
        values = mask.values if is_sparse(mask) else mask
        if tuple(mask.shape) != tuple(shape) or (values.size and not -1 <= values.min() <= values.max() <= 1):
            raise SpmlError(f"{path}: /{name}/{RULES_GROUP}/{rule} is not an int8 {list(shape)} matrix of -1, 0"
                            " and 1: rebuild the cache (extract --force)")
        rules[rule] = mask
    return rules
