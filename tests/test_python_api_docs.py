"""docs/python-api.md's reference is drawn from the package (scripts/python_api.py) and checked here: the page holds
what the declarations and docstrings give now, and every public name (`spml_cache.__all__`, and what `sc.losses`
exports) is documented with its parameters. A new keyword, field or member shows up there by itself, or fails here
until `python scripts/python_api.py --write` is run."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re

import pytest
from cli_support import REPO

import spml_cache as sc
from spml_cache.options.keywords import keyword_options

PAGE = REPO / "docs" / "python-api.md"


def _generator():
    spec = importlib.util.spec_from_file_location("python_api", REPO / "scripts" / "python_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


python_api = _generator()


def _door(name: str):
    value = getattr(sc, name)
    return getattr(value, "face_door", value)


DOORS = [name for name in sc.__all__ if hasattr(_door(name), "declared")]
FUNCTIONS = [name for name in sc.__all__ if name not in DOORS and inspect.isfunction(getattr(sc, name))]
CLASSES = [name for name in sc.__all__ if inspect.isclass(getattr(sc, name))]


def test_the_pages_reference_is_what_the_declarations_and_docstrings_give():
    page = PAGE.read_text(encoding="utf-8")
    assert python_api.written(page, python_api.reference()) == page, (
        "docs/python-api.md's reference is out of date: run python scripts/python_api.py --write")


def test_the_reference_is_drawn_from_the_declarations(monkeypatch):
    """Not blind: a declaration's help, and a docstring's text, each change what is generated."""
    from spml_cache.options import declared
    from spml_cache.options.linear import LinearOptions

    options = LinearOptions.declared()
    reworded = dataclasses.replace(options["epochs"], help="Epochs, as this test words them.")
    monkeypatch.setitem(declared._DECLARED, LinearOptions, {**options, "epochs": reworded})
    monkeypatch.setattr(sc.LossResult.head, "__doc__", "The head, as this test words it.")
    generated = python_api.reference()
    assert "| `epochs` | `--epochs` | whole number |  | Epochs, as this test words them. |" in generated
    assert "| `head() -> dict` | The head, as this test words it. |" in generated
    page = PAGE.read_text(encoding="utf-8")
    assert python_api.written(page, generated) != page


def test_every_public_name_has_a_section_in_the_page_in_the_order_of_all():
    page = PAGE.read_text(encoding="utf-8")
    reference = page[page.index(python_api.BEGIN):page.index(python_api.END)]
    headed = re.findall(r"^### `sc\.([A-Za-z_]+)", reference, flags=re.MULTILINE)
    assert headed == list(sc.__all__)
    assert {"extract", "import_features", "linear", "finetune", "report", "load_cache", "losses"} <= set(sc.__all__)


@pytest.mark.parametrize("name", DOORS)
def test_a_doors_every_keyword_is_declared_with_its_help_and_in_its_signature(name):
    door = _door(name)
    declared = keyword_options(*door.declared)
    assert all(option.help.strip() for _, option in declared.values()), name
    assert all(text.strip() for text in door.own_keywords.values()), name
    shown = set(inspect.signature(door).parameters)
    assert shown == {*declared, *door.own_keywords}, shown ^ {*declared, *door.own_keywords}
    assert inspect.cleandoc(door.__doc__).split("\n\n")[0].strip()


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_functions_every_parameter_is_in_its_docstring(name):
    function = getattr(sc, name)
    documented = [entry[0] for entry in python_api.parameters(function.__doc__)]
    assert documented == list(inspect.signature(function).parameters), name


@pytest.mark.parametrize("name", CLASSES)
def test_a_classs_every_public_member_has_a_docstring_naming_its_parameters(name):
    kind = getattr(sc, name)
    assert python_api.summary(kind.__doc__), name
    for member, value in python_api._members(kind):
        function = python_api._function(value)
        assert python_api.summary(function.__doc__), f"{name}.{member}"
        if inspect.isfunction(function):
            _docstring_names_its_parameters(f"{name}.{member}", function)


def _docstring_names_its_parameters(where: str, function) -> None:
    """Each parameter (self and the catch-alls aside) in its docstring's Parameters section, or named in its text."""
    doc = inspect.getdoc(function) or ""
    listed = {entry[0] for entry in python_api.parameters(doc)}
    for parameter in list(inspect.signature(function).parameters.values()):
        if parameter.name in ("self", "cls") or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        assert parameter.name in listed or re.search(rf"`{parameter.name}`|\b{parameter.name}\b", doc), (
            f"{where}: its docstring does not say what {parameter.name} is")


@pytest.mark.parametrize("name", sorted(sc.losses.__all__))
def test_what_sc_losses_exports_is_documented_with_its_parameters(name):
    value = getattr(sc.losses, name)
    assert python_api.summary(value.__doc__), name
    if inspect.isfunction(value):
        _docstring_names_its_parameters(f"sc.losses.{name}", value)
    page = PAGE.read_text(encoding="utf-8")
    assert f"`sc.losses.{name}" in page, name
