"""The report's backbone column: runs on another backbone's cache are a column of their own, labelled with the
backbone, never mixed with ResNet-50's, and never set beside the papers' (ResNet-50) numbers."""

from __future__ import annotations

import json

import pytest
from cli_support import run_cli
from test_report import make_run

from spml_cache import report
from spml_cache.report import collect


def with_backbone(run, backbone: str) -> None:
    config = json.loads((run / "config.json").read_text())
    config["cache_attrs"]["backbone"] = backbone
    (run / "config.json").write_text(json.dumps(config))


def test_a_backbone_is_a_column_of_its_own(tmp_path):
    make_run(tmp_path, "voc", "linear", {"an": [80.0]}, stamp="20250101-000000", cache_id="cafe0001")
    other = make_run(tmp_path, "voc", "linear", {"an": [85.0]}, stamp="20250102-000000", cache_id="beef0002",
                     weights="resnet10t.c3_in1k")
    with_backbone(other, "timm:resnet10t")
    table = report.build_table(collect.collect_runs([tmp_path]), paper=True)
    labels = [column.label for column in table.columns]
    assert labels == ["VOC linear", "VOC linear [timm:resnet10t]"]  # no "(cache ...)": each backbone has one
    assert [column.backbone for column in table.columns] == ["resnet50", "timm:resnet10t"]
    (_, cells), = table.rows
    assert cells["VOC linear"].mean == 80.0 and cells["VOC linear"].paper is not None
    assert cells["VOC linear [timm:resnet10t]"].mean == 85.0 and cells["VOC linear [timm:resnet10t]"].paper is None
    assert any("backbone timm:resnet10t; the papers' numbers are ResNet-50's" in note for note in table.notes)


@pytest.mark.parametrize("width", ["80", "120", "220"])
def test_the_terminal_table_names_each_backbone_at_any_width(tmp_path, width):
    # brackets in a column label are text, not rich markup: README's `VOC linear [clip:ViT-B-16/openai]`
    for stamp, backbone in (("20250101-000000", "clip:ViT-B-32"), ("20250102-000000", "timm:resnet10t")):
        run = make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0]}, stamp=stamp, cache_id=f"cafe{stamp[-4:]}1")
        with_backbone(run, backbone)
    done = run_cli("report", cwd=tmp_path, env={"COLUMNS": width})
    assert done.returncode == 0, done.stderr
    assert "VOC linear [clip:ViT-B-32]" in done.stdout and "VOC linear [timm:resnet10t]" in done.stdout


def test_a_bracketed_out_path_is_written_and_named(tmp_path):
    make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0], "role": [82.0]}, stamp="20250101-000000")
    done = run_cli("report", "--out", "x[/]y/table.md", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "x[" / "]y" / "table.md").is_file() and "wrote x[/]y/table.md (2 losses" in done.stdout
