"""`sc.make_demo_data(...)`: `spml-cache make-demo-data` from Python, its keywords named as the command's flags and
read and checked by their declarations (options/demo.py's `DemoData`)."""

from __future__ import annotations

from pathlib import Path

from spml_cache.demo.data import write_demo_data
from spml_cache.options.demo import DemoData
from spml_cache.options.keywords import documented, from_flag_keywords, no_positional


def make_demo_data(folder=None, *args, **keywords) -> Path:
    """Write a small synthetic dataset in the real PASCAL VOC 2012 layout into `folder` (which then holds
    VOCdevkit/): coloured shapes of the 20 VOC classes, 1-3 objects per image; `sc.extract("voc", root=folder)`
    reads it. Returns `folder`."""
    no_positional("sc.make_demo_data", args, False)
    given = {"folder": folder, **keywords} if folder is not None else keywords
    (options,) = from_flag_keywords("sc.make_demo_data", given, DemoData)
    return write_demo_data(options)


documented(make_demo_data, DemoData, positional=["folder"], progress=False)
