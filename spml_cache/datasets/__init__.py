"""Dataset readers: one module per dataset, each turning the files users already have into `LabeledImages`.

`read(name, root)` looks for the dataset's layout at `root`, then at `root/<name>` (so one `SPML_DATA` folder
can hold every dataset, e.g. `$SPML_DATA/voc/VOCdevkit/...`), and returns the official train and test splits
with full labels. `survey(root)` is what `spml-cache datasets` finds; `survey_table(root)` is the table it prints.

A reader is a module registered in `READERS` (in the order every listing shows): NAME, TITLE, MARKER, LAYOUT,
ABOUT, `read()` (and `read_areas()` where it has instance areas), and the dataset's values that other parts of the
pipeline look up by dataset (`values_of`), None where it has none:
  EXPECTED_POSITIVES   mean positives per training image as the papers use it (EPR's and ROLE's k)
  PUBLISHED_ID_PREFIX  import-features: what turns the authors' image names into ids under the dataset root
  REPORT_LABEL         the report's name for its columns (the papers' datasets, in the papers' column order)
A new dataset is its reader module, imported and registered below, and its test.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from spml_cache.datasets import coco, csv as csv_reader, cub, nus, openimages, voc
from spml_cache.datasets.base import DatasetSurvey, ImageSplit, LabeledImages
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.registry import Registry

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "DatasetSurvey", "ImageSplit", "LabeledImages", "find_layout", "instance_areas", "names", "read", "reader",
    "resolve_root", "survey", "survey_table", "values_of",
]

READERS: Registry[ModuleType] = Registry("dataset")
for _module in (voc, coco, nus, cub, openimages, csv_reader):
    READERS.register(_module, _module.NAME)


def names() -> list[str]:
    return READERS.names()


def reader(name: str) -> ModuleType:
    """The module that reads `name` (with NAME, TITLE, MARKER, LAYOUT, ABOUT, read() and its values)."""
    return READERS.get(name)


def values_of(value: str) -> dict[str, object]:
    """`{dataset: its reader's VALUE}` (e.g. `EXPECTED_POSITIVES`), in READERS' order, for the datasets that have
    one (not None)."""
    found = {name: getattr(module, value) for name, module in READERS.items()}
    return {name: one for name, one in found.items() if one is not None}


def find_layout(name: str, root: Path) -> Path | None:
    """The folder under `root` that holds the dataset's layout (`root` itself, else `root/<name>`), or None.

    The csv reader also takes a CSV file as its root.
    """
    module = reader(name)
    if name == csv_reader.NAME and root.is_file():
        return root
    for candidate in (root, root / name):
        if any(candidate.glob(module.MARKER)) if "*" in module.MARKER else (candidate / module.MARKER).exists():
            return candidate
    return None


def require_root(root: Path) -> Path:
    root = Path(root).expanduser()
    if not root.exists():
        raise SpmlError(f"data root {root} does not exist; pass --root DIR (or set SPML_DATA) to where the data is")
    return root


def resolve_root(name: str, root: Path) -> Path:
    """The folder that holds the dataset's layout, or an error naming the paths that were looked at."""
    root = require_root(root)
    found = find_layout(name, root)
    if found is None:
        module = reader(name)
        raise SpmlError(
            f"no {module.TITLE} under {root}: expected {root / module.MARKER} (or {root / name / module.MARKER}); "
            f"the layout is {'; '.join(module.LAYOUT)}"
        )
    return found


def read(name: str, root: Path, *, skip_missing: bool = False) -> LabeledImages:
    """The official splits of dataset `name` under `root`; missing image files are an error unless skip_missing."""
    return reader(name).read(resolve_root(name, root), skip_missing=skip_missing)


def instance_areas(images: LabeledImages, ids: list[str]):
    """(largest, total) instance areas, float [N, C], of images `ids` of a dataset read by `read`; None for a
    dataset whose reader has no instance areas (only VOC's boxes are read so far)."""
    module = reader(images.dataset)
    return module.read_areas(images.root, ids) if hasattr(module, "read_areas") else None


def survey(root: Path | None) -> list[DatasetSurvey]:
    """For every dataset: the layout it expects and, given a root, what was found there or what is missing.

    A dataset whose layout is present is read in full (missing image files are counted, not fatal), so the
    answer for a large dataset takes as long as reading it.
    """
    root = None if root is None else require_root(root)
    surveys = []
    for name, module in READERS.items():
        known = dict(dataset=name, title=module.TITLE, layout=list(module.LAYOUT), about=module.ABOUT)
        if root is None:
            surveys.append(DatasetSurvey(**known))
            continue
        found = find_layout(name, root)
        if found is None:
            problem = f"not found: no {root / module.MARKER} (nor {root / name / module.MARKER})"
            surveys.append(DatasetSurvey(**known, root=root, problem=problem))
            continue
        try:
            images = module.read(found, skip_missing=True)
        except SpmlError as err:
            surveys.append(DatasetSurvey(**known, root=found, problem=str(err)))
            continue
        surveys.append(
            DatasetSurvey(
                **known,
                root=images.root,
                found=True,
                counts={"train": len(images.train), "test": len(images.test)},
                num_classes=len(images.classes),
                missing=list(images.skipped),
                notes=list(images.notes),
            )
        )
    return surveys


def survey_table(root: Path | None) -> Table:
    """`survey(root)` as a rich Table: per dataset its name and description, the layout, and (given a root)
    what was found there in green or what is missing in red."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(f"datasets under {root}") if root else "datasets", show_lines=True)
    table.add_column("dataset", ratio=2)
    table.add_column("layout expected under the root", ratio=3, overflow="fold")
    if root is not None:
        table.add_column("found", ratio=3, overflow="fold")
    for entry in survey(root):
        name = Text(f"{entry.dataset}", style="bold") + Text(f"  {entry.title}\n{entry.about}", style="dim")
        cells = [name, "\n".join(entry.layout)]
        if root is not None:
            cells.append(Text("\n".join(entry.summary()), style="green" if entry.found else "red"))
        table.add_row(*cells)
    return table
