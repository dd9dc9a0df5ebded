"""spml-cache: single-positive multi-label learning over a cached feature matrix of a frozen backbone (any: ResNet-50,
the papers', by default).

The Python face, `import spml_cache as sc` (docs/python-api.md): what the command line does, by the same names,
checks and results. Each stage's keywords are its command's flags (`--batch-size` -> `batch_size`, `--from` ->
`from_run`), each taking what the flag takes (a list, or the flag's comma text), and quiet unless `progress=True`:

    sc.make_demo_data(folder, ...)      a small synthetic dataset in the PASCAL VOC layout (`make-demo-data`)
    sc.extract(dataset, root=..., ...)  stage one: a frozen backbone's features into a cache -> ExtractReport
    sc.import_features(folder, ...)     features made elsewhere into a cache -> ImportReport
    sc.load_cache(path)                 a cache's features and labels -> FeatureSet
    sc.linear(cache=..., loss=..., ...) stage two: linear heads, every loss -> LinearRun
    sc.finetune(from_run=..., ...)      stage three: end to end from the best head -> FinetuneRun
    sc.load_run(run_dir)                a finished run -> LinearRun or FinetuneRun
    sc.report(*run_dirs, ...)           the table of runs -> ReportTable (rows, to_markdown(), to_pandas(), ...)
    sc.run(file, ...)                   an experiment file's stages (`spml-cache run`) -> ExperimentRun
    sc.losses                           every loss behind one contract (`sc.losses.build(name, ...)`)

`__all__` is the public surface: these names, their keywords and the fields of what they return stay as they are
across versions (a keyword may be added; one is removed or renamed only with a major version, after a release
that warns). Everything else (the stages' modules and their functions) may change between any two versions.

Importing the package is light: each name is imported when it is first used (the command line's startup relies on
it), and `sc.linear` is the stage's package `spml_cache.linear` itself, called.
"""

from __future__ import annotations

import importlib

from spml_cache.runtime.errors import SpmlError

__version__ = "0.1.0"

# Each public name and where it lives: a module (None: the module is the name) and its attribute. Looked up by name
# when first used (PEP 562), so that `import spml_cache` imports no stage (and no torch).
_PUBLIC = {
    "make_demo_data": ("spml_cache.demo.face", "make_demo_data"),
    "extract": ("spml_cache.extract", None),
    "import_features": ("spml_cache.extract.face", "import_features"),
    "load_cache": ("spml_cache.cache", "load_cache"),
    "linear": ("spml_cache.linear", None),
    "finetune": ("spml_cache.finetune", None),
    "load_run": ("spml_cache.runs.results", "load_run"),
    "report": ("spml_cache.report", None),
    "run": ("spml_cache.experiments.face", "run"),
    "losses": ("spml_cache.losses", None),
    "ExtractReport": ("spml_cache.extract.pipeline", "ExtractReport"),
    "ImportReport": ("spml_cache.extract.published", "ImportReport"),
    "FeatureSet": ("spml_cache.cache.schema", "FeatureSet"),
    "LinearRun": ("spml_cache.runs.results", "LinearRun"),
    "FinetuneRun": ("spml_cache.runs.results", "FinetuneRun"),
    "LossResult": ("spml_cache.runs.results", "LossResult"),
    "ReportTable": ("spml_cache.report.face", "ReportTable"),
    "ExperimentRun": ("spml_cache.experiments.run", "ExperimentRun"),
}

__all__ = [*_PUBLIC, "SpmlError"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'spml_cache' has no attribute {name!r}")
    module_name, attribute = _PUBLIC[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
