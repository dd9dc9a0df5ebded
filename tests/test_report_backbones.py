"""The report's backbone column: runs on another backbone's cache are a column of their own, labelled with the
backbone, never mixed with ResNet-50's, and never set beside the papers' (ResNet-50) numbers."""

from __future__ import annotations

import json

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
