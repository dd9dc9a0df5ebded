"""runtime/plugins.py, the one loader of losses and backbones from outside the package: the same three forms for
both (`file.py:Name`, `module:Name`, an entry point), one origin record with the same keys for both, one renderer,
and the records earlier versions wrote read as today's."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
from cli_support import REPO, run_main

from spml_cache import backbones, losses
from spml_cache.losses import plugins as loss_plugins
from spml_cache.runtime import plugins
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.plugins import Origin

EXAMPLE = REPO / "examples" / "masked_focal.py"
# One module holding a loss and a backbone; `make` is the backbone (a channel mean per image, width 3).
TWIN = EXAMPLE.read_text().replace('"masked_focal"', '"twin_focal"') + """

from spml_cache.backbones.preprocess import Preprocess


def make():
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()), Preprocess(8), 3
"""


@pytest.fixture(autouse=True)
def no_plugins_loaded(monkeypatch):
    monkeypatch.setattr(loss_plugins, "_LOADED", {})


def write_distribution(site: Path, name: str, entry_points: str, version: str = "1.0") -> None:
    """An installed distribution as pip leaves it: a dist-info folder with its entry_points.txt."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_a_loss_and_a_backbone_from_each_form_have_one_origin_record_with_the_same_keys(tmp_path, monkeypatch):
    (tmp_path / "twin45file.py").write_text(TWIN)
    site = tmp_path / "site"
    site.mkdir()
    (site / "twin45mod.py").write_text(TWIN)
    (site / "twin45ep.py").write_text(TWIN)
    write_distribution(site, "twin45dist", "[spml_cache.losses]\ntwin_focal = twin45ep:MaskedFocal\n"
                                           "[spml_cache.backbones]\ntwin45net = twin45ep:make\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(tmp_path)
    forms = {"file": ("twin45file.py:MaskedFocal", "twin45file.py:make"),
             "module": ("twin45mod:MaskedFocal", "twin45mod:make"),
             "entry_point": ("twin_focal", "twin45net")}
    for kind, (loss_spec, backbone_spec) in forms.items():
        monkeypatch.setattr(loss_plugins, "_LOADED", {})
        loss_record = loss_plugins.origin(losses.get(loss_spec).name)
        described = backbones.describe(backbone_spec)
        backbone_record = json.loads(described.attrs()["backbone_origin"])
        assert loss_record["kind"] == backbone_record["kind"] == kind
        assert set(loss_record) == set(backbone_record), kind
        assert loss_record["sha256"] == backbone_record["sha256"]
    # the file form's record loads it again from any folder; the cache knows it by the file's name
    assert loss_record["distribution"] == "twin45dist" and backbone_record["version"] == "1.0"
    file_record = Origin.read(json.loads(backbones.describe("twin45file.py:make").attrs()["backbone_origin"]))
    assert file_record.spec == f"{tmp_path / 'twin45file.py'}:make"
    assert file_record.sha256 == hashlib.sha256(TWIN.encode()).hexdigest()
    assert backbones.describe(file_record.spec).backbone == "twin45file.py:make"


# What the code before the one loader wrote, restated with its keys: a loss's entry point ("entry point"), a
# backbone module's file ("file"), a backbone entry point's name ("name", and no file or hash).
SHA = "ab" * 32
OLD_LOSS_ENTRY = {"kind": "entry point", "spec": "plug_focal", "value": "spmlplug:MaskedFocal",
                  "path": "/site/spmlplug/__init__.py", "sha256": SHA, "distribution": "spmlplug", "version": "1.2"}
OLD_BACKBONE_MODULE = json.dumps({"kind": "module", "spec": "mynets:fn", "module": "mynets",
                                  "file": "/code/mynets.py", "sha256": SHA}, sort_keys=True)
OLD_BACKBONE_ENTRY = json.dumps({"kind": "entry_point", "name": "my_r18", "value": "mynets:fn",
                                 "distribution": "mynets", "version": "1.0"}, sort_keys=True)
OLD_BACKBONE_NO_FILE = {"kind": "module", "spec": "m:fn", "module": "m", "file": None, "sha256": None}


def test_records_in_an_earlier_versions_keys_read_as_todays():
    assert Origin.read(OLD_LOSS_ENTRY) == Origin(kind="entry_point", spec="plug_focal", value="spmlplug:MaskedFocal",
                                                 path="/site/spmlplug/__init__.py", sha256=SHA,
                                                 distribution="spmlplug", version="1.2")
    assert Origin.read(OLD_BACKBONE_MODULE).as_dict() == {"kind": "module", "spec": "mynets:fn", "path":
                                                          "/code/mynets.py", "sha256": SHA, "module": "mynets"}
    assert Origin.read(OLD_BACKBONE_ENTRY) == Origin(kind="entry_point", spec="my_r18", value="mynets:fn",
                                                     distribution="mynets", version="1.0")
    assert Origin.read(OLD_BACKBONE_NO_FILE) == Origin(kind="module", spec="m:fn", module="m")
    # today's code finds more (the entry point's file and hash): a key the old record lacks is not compared
    now = Origin(kind="entry_point", spec="my_r18", value="mynets:fn", path="/site/mynets.py", sha256=SHA,
                 distribution="mynets", version="1.0")
    assert Origin.read(OLD_BACKBONE_ENTRY).change(now) is None
    assert Origin.read(OLD_BACKBONE_ENTRY).change(replace(now, version="1.1")) == (
        "version 1.0 then, 1.1 now: /site/mynets.py")
    moved = Origin.read(OLD_BACKBONE_MODULE)
    assert moved.change(replace(moved, path="/elsewhere/mynets.py")) is None  # the same contents elsewhere
    assert moved.change(replace(moved, sha256="cd" * 32)) == f"sha256 {SHA[:16]} then, {'cd' * 8} now: /code/mynets.py"


def test_one_renderer_says_where_each_kind_came_from():
    assert Origin.read(OLD_LOSS_ENTRY).text() == ("entry point plug_focal = spmlplug:MaskedFocal, spmlplug 1.2,"
                                                  f" /site/spmlplug/__init__.py, sha256 {SHA[:12]}")
    assert Origin.read(OLD_BACKBONE_MODULE).text() == f"mynets:fn, /code/mynets.py, sha256 {SHA[:12]}"
    file = Origin(kind="file", spec="/code/mynets.py:fn", path="/code/mynets.py", sha256=SHA)
    assert file.text() == f"/code/mynets.py:fn, sha256 {SHA[:12]}"


def test_two_distributions_naming_one_loss_or_backbone_are_refused_in_one_line(tmp_path, monkeypatch):
    site = tmp_path / "site"
    for number in (1, 2):
        (site / f"dup45m{number}").mkdir(parents=True)
        (site / f"dup45m{number}" / "__init__.py").write_text(TWIN.replace('"twin_focal"', '"dup45"'))
        write_distribution(site, f"dup45d{number}", f"[spml_cache.losses]\ndup45 = dup45m{number}:MaskedFocal\n"
                                                    f"[spml_cache.backbones]\ndup45 = dup45m{number}:make\n")
    monkeypatch.syspath_prepend(str(site))
    for get, flag in ((losses.get, "--loss"), (backbones.describe, "--backbone")):
        with pytest.raises(SpmlError) as error:
            get("dup45")
        line = str(error.value)
        assert line.startswith(f"{flag} dup45: 2 installed entry points of spml_cache.") and "\n" not in line
        assert "dup45m1:" in line and "dup45d2 1.0" in line and "or uninstall the other" in line


def test_a_plugin_that_exits_at_import_is_one_line_not_a_silent_exit(tmp_path, monkeypatch, capsys):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    code, err = run_main("check-loss", "exits.py:Loss", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and line == ("error: exits.py:Loss: importing it raised SystemExit: 3; fix the plugin"
                                  " (run it with python to see the traceback)")
    with pytest.raises(SpmlError, match="--backbone exits.py:make: importing it raised SystemExit: 3"):
        backbones.describe("exits.py:make")
