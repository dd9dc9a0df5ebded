"""A cache split's per-row arrays (the features and, for CLIP backbones, the embeddings) as the columns of one
wide row, the form stage one's trunk gives them in; and the CLIP text side's group.
"""

from __future__ import annotations

import json

import h5py
import numpy as np

# A split's per-row arrays, in the order their columns come in a row of stage one's trunk output: the features,
# then, for CLIP backbones, the normalised image embedding and the crops' embeddings (extract --crops).
ROW_DATASETS = ("features", "image_embeddings", "crop_embeddings")
TEXT_GROUP = "text"  # /text/embeddings: float32 [C, E], attr templates (JSON), for CLIP backbones
RowShapes = dict[str, tuple[int, ...]]  # {per-row dataset: its shape per row}


def row_shapes(group: h5py.Group) -> RowShapes:
    """The per-row datasets a split of a file holds, and their shapes per row, in column order."""
    return {name: tuple(group[name].shape[1:]) for name in ROW_DATASETS if name in group}


def width(shapes: RowShapes) -> int:
    return sum(int(np.prod(shape)) for shape in shapes.values())


def write_wide(group: h5py.Group, start: int, stop: int, wide: np.ndarray) -> None:
    """Rows [start, stop) of every per-row dataset from the columns of `wide` [stop - start, width]."""
    column = 0
    for name, shape in row_shapes(group).items():
        width = int(np.prod(shape))
        group[name][start:stop] = wide[:, column : column + width].reshape(len(wide), *shape)
        column += width


def read_wide(group: h5py.Group, rows: slice) -> np.ndarray:
    """Rows of every per-row dataset side by side, as `write_wide` takes them."""
    parts = [group[name][rows] for name in row_shapes(group)]
    return np.concatenate([part.reshape(len(part), -1) for part in parts], axis=1)


def write_text(file: h5py.File, text: dict | None) -> None:
    """`text` = {"embeddings": float32 [C, E], "templates": [str]} -> /text/embeddings with attr templates."""
    if text is None:
        return
    group = file.require_group(TEXT_GROUP)
    data = group.create_dataset("embeddings", data=np.asarray(text["embeddings"], dtype=np.float32))
    data.attrs["templates"] = json.dumps(list(text["templates"]))
