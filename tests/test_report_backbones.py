"""The report's backbone column: runs on another backbone's cache are a column of their own, labelled with the
backbone (and its feature kind), never mixed with ResNet-50's, and never set beside the papers' (ResNet-50)
numbers; `--pivot backbone` tabulates one dataset's linear runs as losses x backbones, with its figure."""

from __future__ import annotations

import json

import pytest
from cli_support import run_cli, run_main
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


def with_cache_attrs(run, **attrs) -> None:
    config = json.loads((run / "config.json").read_text())
    config["cache_attrs"].update(attrs)
    (run / "config.json").write_text(json.dumps(config))


@pytest.fixture
def backbone_runs(tmp_path):
    """VOC linear runs on three caches (ResNet-50, ViT-B/16 pooled and last4) and one fine-tuned run; COCO apart."""
    root = tmp_path / "runs"
    make_run(root, "voc", "linear", {"bce": [95.0], "an": [80.0], "role": [82.0]}, stamp="20250101-000000",
             cache_id="cafe0001")
    vit = make_run(root, "voc", "linear", {"an": [85.0, 87.0], "role": [84.0, 84.0]}, stamp="20250102-000000",
                   cache_id="beef0002")
    with_cache_attrs(vit, backbone="vit_b_16")
    last4 = make_run(root, "voc", "linear", {"an": [88.0]}, stamp="20250103-000000", cache_id="feed0003")
    with_cache_attrs(last4, backbone="vit_b_16", features="last4")
    make_run(root, "voc", "finetune", {"an": [90.0]}, stamp="20250104-000000", cache_id="cafe0001")
    make_run(root, "coco", "linear", {"an": [70.0]}, stamp="20250105-000000", cache_id="dead0004")
    return root


def test_the_pivot_is_losses_by_backbone_and_feature_kind(backbone_runs, tmp_path):
    done = run_cli("report", str(backbone_runs / "voc"), "--pivot", "backbone", "--format", "json",
                   "--plots", str(tmp_path / "figures"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    assert [column["label"] for column in payload["columns"]] == ["resnet50", "vit_b_16", "vit_b_16+last4"]
    cells = {row["loss"]: {label: cell["mean"] for label, cell in row["cells"].items()} for row in payload["rows"]}
    assert cells == {"bce": {"resnet50": 95.0}, "an": {"resnet50": 80.0, "vit_b_16": 86.0, "vit_b_16+last4": 88.0},
                     "role": {"resnet50": 82.0, "vit_b_16": 84.0}}
    best = {(row["loss"], label) for row in payload["rows"] for label, cell in row["cells"].items() if cell["best"]}
    assert best == {("role", "resnet50"), ("an", "vit_b_16"), ("an", "vit_b_16+last4")}  # bce is an oracle
    assert any("left out of the pivot" in note and "fine-tuned" in note for note in payload["notes"])
    png = tmp_path / "figures" / "voc-loss_by_backbone.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in done.stdout.replace("\n", "")


def test_the_pivot_refuses_several_datasets_and_unknown_pivots(backbone_runs, tmp_path, monkeypatch, capsys):
    done = run_cli("report", str(backbone_runs), "--pivot", "backbone", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "--pivot backbone: the runs are of coco, voc: name one dataset's runs" in line
    code, stderr = run_main("report", str(backbone_runs), "--pivot", "dataset", cwd=tmp_path,
                            monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "--pivot dataset: use backbone" in stderr


def test_the_report_names_a_weight_decay_only_where_it_is_not_0(tmp_path):
    run = make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0], "role": [82.0]}, stamp="20250101-000000")
    results = json.loads((run / "results.json").read_text())
    results["losses"]["an"]["selected"]["wd"] = 1e-4
    results["losses"]["role"]["selected"]["wd"] = 0.0  # 0 won: the papers' grid, said once in a note
    (run / "results.json").write_text(json.dumps(results))
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "wds": [0.0, 1e-4, 1e-3]}))
    done = run_cli("report", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "80.00 (wd=0.0001)" in done.stdout and "82.00 *" in done.stdout and "wd=0)" not in done.stdout
    note = "VOC linear: weight decay selected per loss from 0, 0.0001, 0.001 (--wd); a cell names it where it is not 0"
    assert done.stdout.count(note) == 1
    (_, an), (_, role) = report.build_table(collect.collect_runs([tmp_path / "runs"])).rows
    assert an["VOC linear"].swept == {"wd": 1e-4} and role["VOC linear"].swept == {"wd": 0.0}  # the files keep it


LONG = "timm:vit_base_patch14_dinov2.lvd142m"


def header_labels(stdout: str) -> list[str]:
    """The terminal table's column labels as drawn, each column's header lines joined (spaces left out)."""
    lines = stdout.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    bottom = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    cells = [line.strip("┃").split("┃") for line in lines[top + 1:bottom]]
    return ["".join(row[i] for row in cells).replace(" ", "") for i in range(len(cells[0]))]


@pytest.mark.parametrize("width", ["60", "80", "220"])
def test_the_terminal_table_names_each_backbone_and_feature_kind_whole_at_any_width(tmp_path, width):
    # brackets in a column label are text, not rich markup: README's `VOC linear [clip:ViT-B-16/openai]`; and four
    # columns at 80 characters once drew `[resnet50+las…` and two long names alike as `[timm:vit_bas…`
    backbones = [("clip:ViT-B-32", None), ("resnet50", "last4"), (LONG, None), (LONG, "last4")]
    for day, (backbone, features) in enumerate(backbones, start=1):
        run = make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0 + day]}, stamp=f"2025010{day}-000000",
                       cache_id=f"cafe000{day}")
        with_cache_attrs(run, backbone=backbone, **({"features": features} if features else {}))
    done = run_cli("report", cwd=tmp_path, env={"COLUMNS": width})
    assert done.returncode == 0, done.stderr
    labels = ["VOC linear [clip:ViT-B-32]", "VOC linear [resnet50+last4]", f"VOC linear [{LONG}]",
              f"VOC linear [{LONG}+last4]"]
    assert header_labels(done.stdout) == ["loss", *(label.replace(" ", "") for label in labels)]
    assert "…" not in done.stdout and all(len(line) <= int(width) for line in done.stdout.splitlines())
    if width == "220":  # room for each whole on its line
        assert all(label.split(" [")[1][:-1] in done.stdout for label in labels)


def test_a_bracketed_out_path_is_written_and_named(tmp_path):
    make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0], "role": [82.0]}, stamp="20250101-000000")
    done = run_cli("report", "--out", "x[/]y/table.md", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "x[" / "]y" / "table.md").is_file() and "wrote x[/]y/table.md (2 losses" in done.stdout
