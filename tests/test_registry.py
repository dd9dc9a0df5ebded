"""The one registry idiom (runtime/registry.py) and the four registries built on it: losses, observation rules,
datasets and backbone families; and a dataset's own values, read from its reader."""

import importlib
import subprocess
import sys

import pytest

from spml_cache import backbones, datasets, losses, observation
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.registry import Registry


class _Named:
    def __init__(self, name):
        self.name = name


def test_names_in_registration_order_lookup_and_refusal_with_the_closest_name():
    registry = Registry("colour", listing="pick one of")
    for name in ("red", "green", "blue"):
        registry.register(_Named(name))
    assert registry.names() == ["red", "green", "blue"] == list(registry)
    assert len(registry) == 3 and "green" in registry and "grey" not in registry
    assert registry.get("blue").name == "blue" and registry.find("grey") is None
    with pytest.raises(SpmlError) as error:
        registry.get("gren", where="--colour gren: ", hint=" (see the docs)")
    assert str(error.value) == ("--colour gren: unknown colour 'gren' (did you mean green?); pick one of red, green,"
                                " blue (see the docs)")
    with pytest.raises(SpmlError) as error:
        registry.get("zzz")
    assert "did you mean" not in str(error.value)  # nothing close: no guess


def test_a_name_registered_twice_is_refused_and_shown_names_come_from_the_entries():
    registry = Registry("rule", listing="use", shown=lambda name, entry: f"{name}:{entry.name.upper()}")
    registry.register(_Named("a"))
    registry.register(_Named("x"), name="b")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(_Named("a"))
    assert registry.valid() == "use a:A, b:X"
    assert [(name, entry.name) for name, entry in registry.items()] == [("a", "a"), ("b", "x")]


def test_a_lazy_entry_is_loaded_only_when_asked_for_and_its_failure_is_not_kept():
    registry = Registry("family")
    calls = []

    def load():
        calls.append(1)
        if len(calls) == 1:
            raise SpmlError("needs its package")
        return _Named("late")

    registry.register_lazy("late", load)
    assert "late" in registry and registry.names() == ["late"] and calls == []  # listing loads nothing
    with pytest.raises(SpmlError, match="needs its package"):
        registry.get("late")
    assert registry.get("late").name == "late" and len(calls) == 2  # asked again: the check ran again


def test_the_four_registries_list_what_their_modules_define():
    import spml_cache.losses.base as loss_base
    import spml_cache.observation.draws as draws

    defined = [cls.name for module in map(importlib.import_module, _loss_modules()) for cls in vars(module).values()
               if isinstance(cls, type) and issubclass(cls, loss_base.Loss) and "name" in cls.__dict__]
    assert sorted(losses.names()) == sorted(set(defined))
    rules = {cls.name for cls in vars(draws).values()
             if isinstance(cls, type) and issubclass(cls, observation.ObservationRule) and "name" in cls.__dict__}
    assert set(observation.RULES) == rules and observation.RULES.names()[0] == "single"
    assert datasets.names() == ["voc", "coco", "nus", "cub", "openimages", "csv"]
    assert backbones.FAMILIES.names() == ["tv", "timm", "clip", "plugin"]


def _loss_modules():
    import spml_cache.losses as package
    from pathlib import Path

    skip = {"__init__", "base", "contract", "overrides", "plugins"}
    return [f"spml_cache.losses.{path.stem}" for path in Path(package.__file__).parent.glob("*.py")
            if path.stem not in skip]


def test_backbone_families_are_imported_only_when_used():
    code = ("import sys, spml_cache.backbones as b; b.family_of('timm:x'); b.family_of('clip:A/t');"
            " print(any(m in sys.modules for m in ('spml_cache.backbones.timm_models','spml_cache.backbones.clip_models',"
            " 'timm', 'open_clip')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_every_backbone_family_is_a_registered_family_with_one_signature_and_nothing_branches_by_family():
    import inspect
    import re
    from pathlib import Path

    for name, family in backbones.FAMILIES.items():
        assert issubclass(family, backbones.Family) and family.name == name and family.called
        assert list(inspect.signature(family.describe).parameters) == ["request"]
        assert list(inspect.signature(family.build).parameters) == ["description"]
        assert set(family.takes) <= set(backbones.OPTIONS) and set(family.features) <= set(backbones.FEATURES)
    # what a family does differently is declared on it, never asked of its name
    asked = re.compile(r"""(==|!=|\bin)\s*\(?["'](tv|timm|clip|plugin)["']|\.family\s*[!=]="""
                       r"""|family_of\([^)]*\)\[0\]\s*[!=]=""")
    package = Path(backbones.__file__).parents[1]
    found = [f"{path.relative_to(package)}: {line.strip()}" for path in package.rglob("*.py")
             for line in path.read_text().splitlines() if asked.search(line)]
    assert found == []


def test_plugin_is_not_a_prefix_a_name_may_start_with():
    with pytest.raises(SpmlError) as error:
        backbones.family_of("plugn:x")
    assert "unknown backbone family 'plugn'" in str(error.value) and "did you mean plugin" not in str(error.value)


# The papers' values, restated here as the papers give them (Cole et al. 2021, Table A3; the authors' image folders).
PAPERS_K = {"voc": 1.5, "coco": 2.9, "nus": 1.9, "cub": 31.4}
AUTHORS_PREFIX = {"voc": "VOCdevkit/VOC2012/JPEGImages/", "coco": "", "nus": "Flickr/", "cub": "CUB_200_2011/images/",
                  "csv": ""}


def test_a_datasets_own_values_are_on_its_reader_and_every_user_reads_them_there():
    from spml_cache.extract import published
    from spml_cache.losses.estimating import ExpectedPositiveRegularization
    from spml_cache.report import collect

    assert datasets.values_of("EXPECTED_POSITIVES") == PAPERS_K
    assert ExpectedPositiveRegularization.dataset_defaults == {name: {"k": k} for name, k in PAPERS_K.items()}
    assert losses.get("role").dataset_defaults == ExpectedPositiveRegularization.dataset_defaults
    assert published.ID_PREFIX == AUTHORS_PREFIX
    assert collect.DATASET_LABELS == {"voc": "VOC", "coco": "COCO", "nus": "NUS", "cub": "CUB"}
    for module in (datasets.reader(name) for name in datasets.names()):  # every reader declares all three
        assert {"EXPECTED_POSITIVES", "PUBLISHED_ID_PREFIX", "REPORT_LABEL"} <= set(vars(module)), module.NAME


def test_a_new_reader_is_listed_and_its_values_read_without_touching_another_file(monkeypatch):
    import types

    module = types.ModuleType("toy")
    module.NAME, module.EXPECTED_POSITIVES, module.PUBLISHED_ID_PREFIX, module.REPORT_LABEL = "toy", 4.0, None, None
    registry = Registry("dataset")
    for name in datasets.names():
        registry.register(datasets.reader(name), name)
    registry.register(module, "toy")
    monkeypatch.setattr(datasets, "READERS", registry)
    assert datasets.names()[-1] == "toy" and datasets.values_of("EXPECTED_POSITIVES")["toy"] == 4.0
    assert "toy" not in datasets.values_of("PUBLISHED_ID_PREFIX")  # None: the reader has none


def test_a_losses_params_and_a_plugins_bounds_shorthand_constrain_alike():
    from spml_cache.losses import Loss
    from spml_cache.runtime.registry import Param

    class Declared(Loss):
        params = (Param.between("w", 0.0, 1.0, "(]"),)

    class Shorthand(Loss):
        bounds = {"w": (0.0, 1.0, "(]")}

    def inside(value):  # (0, 1], restated
        return 0.0 < value <= 1.0

    for cls in (Declared, Shorthand):
        param = cls.constraints()["w"]
        assert [param.valid(v) for v in (-1.0, 0.0, 0.5, 1.0, 1.5)] == [inside(v) for v in (-1.0, 0.0, 0.5, 1.0, 1.5)]
        assert param.must == "in (0, 1]" and (param.low, param.high) == (0.0, 1.0)
    with pytest.raises(SpmlError, match=r"--hp an_ls\.ls=1: outside its valid range \[0, 1\)"):
        losses.build("an_ls", num_classes=3, ls=1.0)
    with pytest.raises(ValueError, match="brackets"):
        Param.between("w", 0.0, 1.0, "[")
