"""A tiny CLIP for the tests: an open_clip model config registered under TINY_CLIP (random weights only)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_CLIP = "spml-tiny-clip"
TINY_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 1, "layers": 1},
}


def tiny_clip_config(folder: Path) -> Path:
    """The config file (open_clip names a model after its config file's stem)."""
    path = Path(folder) / f"{TINY_CLIP}.json"
    path.write_text(json.dumps(TINY_CLIP_CONFIG))
    return path


def register_tiny_clip(folder: Path) -> str:
    import open_clip

    open_clip.add_model_config(tiny_clip_config(folder))
    return TINY_CLIP
