"""The report's figures as paper material: every figure it makes, at a paper's column and text width, checked as
saved (matplotlib's own layout: no text under 7 pt, none over another or over a legend, nothing outside the
figure), written as png, pdf or svg at the width and resolution asked for, and headings that count right."""

from __future__ import annotations

import json
import re
import struct
import zlib

import pytest
from cli_support import run_cli, run_main
from figure_support import layout_faults
from test_report import PNG_SIGNATURE, make_run
from test_report_backbones import with_cache_attrs

from spml_cache import report
from spml_cache.report import observed_fraction, plots, val_curves
from spml_cache.report.figure_files import FigureFiles
from spml_cache.report.pivot import draw_backbones, pivot_backbone

LOSSES = ["bce", "an", "an_ls", "wan", "l1r", "epr", "role", "ll_r"]  # more than one panel of validation curves
# COCO's longest class names, and enough others for COCO's 80
CLASSES = ["traffic light", "fire hydrant", "parking meter", "baseball glove", "tennis racket", "potted plant",
           "cell phone", "teddy bear", "hair drier", "toothbrush", *(f"object {i}" for i in range(70))]


def edit(path, change) -> None:
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload))


def coco_run(root):
    """A COCO run whose data asks for every figure of a column: 80 classes, `ll_r`'s delta swept, and `an` and
    `role` under two `entry:P` rules as well (the observed-fraction figure)."""
    run = make_run(root, "coco", "linear", {name: [50.0 + i] for i, name in enumerate(LOSSES)},
                   stamp="20250101-000000")
    edit(run / "config.json", lambda config: config.update(classes=CLASSES))

    def results(payload):
        for i, entry in enumerate(payload["losses"].values()):
            entry["per_class_ap"] = [(7 * c + 3 * i) % 90 + 5.0 for c in range(len(CLASSES))]
        swept = payload["losses"]["ll_r"]
        swept["selected"]["swept"] = {"delta": 0.003}
        swept["configs"] = [{"lr": 1e-3, "batch_size": 8, "seed": 0, "best_epoch": 4, "val_map": 60.0 + 10 * delta,
                             "test_map": 60.0, "hparams": {"delta": delta}} for delta in (0.001, 0.002, 0.003, 0.004)]
        for loss in ("an", "role"):
            for fraction in (0.1, 0.5):
                payload["losses"][f"{loss}@entry:{fraction}"] = {
                    "loss": loss, "rule": f"entry:{fraction}", "test_map": 30.0 + 20 * fraction + len(loss),
                    "selected": {"lr": 1e-3, "batch_size": 8, "hparams": {}}, "per_seed": [{}]}

    edit(run / "results.json", results)
    return run


def backbone_runs(root):
    """VOC linear runs on ResNet-50 and on a long-named timm backbone, pooled and last4: the pivot figure."""
    make_run(root, "voc", "linear", {"bce": [95.0], "an": [80.0], "role": [82.0]}, stamp="20250101-000000",
             cache_id="cafe0001")
    for stamp, features in (("20250102-000000", None), ("20250103-000000", "last4")):
        run = make_run(root, "voc", "linear", {"an": [85.0, 87.0], "role": [84.0, 86.0]}, stamp=stamp,
                       cache_id=f"beef{stamp[7]}")
        with_cache_attrs(run, backbone="timm:vit_base_patch14_dinov2.lvd142m",
                         **({"features": features} if features else {}))
    return root / "voc"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("width", [3.3, 6.9], ids=["column", "text"])
def test_every_figure_reads_at_its_saved_size(tmp_path, width):
    coco_run(tmp_path / "coco")
    figures = plots.draw_runs(report.collect_runs([tmp_path / "coco"]), width=width)
    table = pivot_backbone(report.build_table(report.collect_runs([backbone_runs(tmp_path / "voc")])))
    figures.append(("voc-loss_by_backbone", draw_backbones(plots.require_matplotlib(), table, width)))
    assert sorted(stem for stem, _ in figures) == sorted(
        [f"coco_linear-{kind}" for kind in ("val_curves", "per_class_ap", "train_histograms", "label_recovery",
                                            "sweeps", "observed_fraction")] + ["voc-loss_by_backbone"])
    files, vector = FigureFiles("png", 50, width), FigureFiles("pdf", 50, width)
    for stem, figure in figures:
        path = files.path(tmp_path, stem)
        assert layout_faults(figure, lambda drawn: files.write(path, drawn)) == [], stem
        png_width, png_height = png_size(path.read_bytes())  # saved at its own size: nothing cropped or scaled
        assert (png_width, png_height) == (round(width * 50), round(figure.get_figheight() * 50)), stem
        vector.write(vector.path(tmp_path, stem), figure)  # and as set in the file: no text under 7 pt (a 10^2's
        (page_width, _), sizes = pdf_page_and_font_sizes(vector.path(tmp_path, stem).read_bytes())  # exponent...)
        assert page_width == pytest.approx(width * 72, abs=0.01) and min(sizes) >= 7, (stem, sorted(sizes))
    legend = dict(figures)["voc-loss_by_backbone"].axes[0].get_legend()  # each backbone's marker, no error bar
    assert [(type(handle).__name__, handle.get_marker(), handle.get_linestyle()) for handle in legend.legend_handles] \
        == [("Line2D", "o", "None")] * 3
    assert [text.get_text() for text in legend.get_texts()] == [
        "resnet50", "timm:vit_base_patch14_dinov2.lvd142m", "timm:vit_base_patch14_dinov2.lvd142m+last4"]
    # COCO's 80 class names need 0.13 in each, upright: too many for a paper's text width, whose figure says the
    # width that names them; at that width every one is there, and reads
    per_class = dict(figures)["coco_linear-per_class_ap"]
    assert [label.get_text() for label in per_class.axes[0].get_xticklabels()] == []
    (needed,) = re.fullmatch(r"80 classes \(named from --figure-width ([\d.]+)\)", per_class.axes[0].get_xlabel()).groups()
    wide = plots.draw_runs(report.collect_runs([tmp_path / "coco"]), width=float(needed), compare=("an", "role"))
    named = dict(wide)["coco_linear-per_class_ap"]
    assert [label.get_text() for label in named.axes[0].get_xticklabels()] == CLASSES
    assert layout_faults(named) == []


def test_the_layout_check_finds_small_text_overlaps_and_a_covered_legend():
    figure = plots.require_matplotlib()(figsize=(4, 3))
    axes = figure.subplots()
    axes.plot([0, 1], [0, 1], label="a line")
    axes.legend(loc="center", fontsize=8)
    axes.text(0.5, 0.5, "over the legend", ha="center", fontsize=9)
    axes.text(0.05, 0.9, "tiny", fontsize=6)
    axes.text(0.05, 0.9, "tinier", fontsize=6.5)
    faults = layout_faults(figure)
    assert "'tiny' is 6 pt, under 7" in faults and "'tinier' is 6.5 pt, under 7" in faults
    assert "'tiny' overlaps 'tinier'" in faults and "'over the legend' is drawn over a legend" in faults
    assert len(faults) == 5, faults  # and 'over the legend' over the legend's own text


def test_figures_as_pdf_svg_and_png_at_the_dpi_asked_for(tmp_path, monkeypatch, capsys):
    make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0], "role": [82.0]}, stamp="20250101-000000")
    kinds = ["label_recovery", "per_class_ap", "train_histograms", "val_curves"]
    done = run_cli("report", "--plots", "figures", "--figure-format", "pdf", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    written = sorted((tmp_path / "figures").iterdir())
    assert [path.name for path in written] == [f"voc_linear-{kind}.pdf" for kind in kinds]
    assert all(f"wrote figures/{path.name}" in done.stdout for path in written)
    # progress as they are drawn and written (plain lines off a terminal: rate and ETA, the last at the total)
    assert re.search(r"^drawing the figures: 5/5 figures \(.* ETA 0 s\)$", done.stderr, re.M), done.stderr
    assert re.search(r"^writing the figures into figures: 4/4 figures \(", done.stderr, re.M), done.stderr
    for path in written:
        data = path.read_bytes()
        assert data.startswith(b"%PDF-") and b"/FontFile2" in data  # TrueType fonts embedded,
        assert b"/Type3" not in data and b"/CreationDate" not in data  # none of Type 3; undated: reproducible
    code, err = run_main("report", "--plots", "svg", "--figure-format", "svg", cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    assert code == 0, err
    svgs = sorted((tmp_path / "svg").iterdir())
    assert [path.name for path in svgs] == [f"voc_linear-{kind}.svg" for kind in kinds]
    assert all("<svg" in path.read_text() and "<dc:date>" not in path.read_text() for path in svgs)
    code, err = run_main("report", "--plots", "png", "--dpi", "120", cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    assert code == 0, err
    for path in (tmp_path / "png").iterdir():
        data = path.read_bytes()
        per_metre = struct.unpack(">II", data[data.index(b"pHYs") + 4:][:8])
        assert data[:8] == PNG_SIGNATURE and per_metre == (round(120 / 0.0254),) * 2, path  # made at 120 dpi


@pytest.mark.parametrize(("flags", "expected"), [
    (["--dpi", "20"], "error: --dpi 20: use 50 to 600 (for any size, --figure-format pdf or svg: vector)"),
    (["--figure-format", "gif"], "error: --figure-format gif: use one of png, pdf, svg"),
])
def test_a_figure_format_or_dpi_out_of_range_is_one_line(tmp_path, monkeypatch, capsys, flags, expected):
    make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0]}, stamp="20250101-000000")
    code, err = run_main("report", "--plots", "figures", *flags, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and err.strip() == expected and not (tmp_path / "figures").exists()


def test_the_figure_flags_without_plots_are_refused(tmp_path, monkeypatch, capsys):
    make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0]}, stamp="20250101-000000")
    code, err = run_main("report", "--figure-format", "pdf", "--dpi", "150", cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    assert code == 1 and err.strip() == ("error: --figure-format and --dpi: only with --plots DIR (the folder the"
                                         " figures go into)")
    code, err = run_main("report", "--figure-width", "column", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and err.strip().startswith("error: --figure-width: only with --plots DIR")


def pdf_page_and_font_sizes(data: bytes) -> tuple[tuple[float, float], set[float]]:
    """A one-page PDF's page size in points (its MediaBox) and the sizes of the fonts its text is set in (each
    `/F1 7 Tf` of its content streams, inflated as a reader would)."""
    (box,) = re.findall(rb"/MediaBox \[ *0 0 ([\d.]+) ([\d.]+) *\]", data)
    sizes = set()
    for stream in re.findall(rb"stream\r?\n(.*?)\r?\nendstream", data, re.S):
        try:
            text = zlib.decompress(stream)
        except zlib.error:  # a font file or an image: not page content
            continue
        sizes |= {float(size) for size in re.findall(rb"/F\d+ ([\d.]+) Tf", text)}
    return (float(box[0]), float(box[1])), sizes


@pytest.mark.parametrize(("flag", "inches"), [("column", 3.3), ("text", 6.9), ("5", 5.0)])
def test_figures_are_as_wide_as_asked_and_their_text_7_pt_or_more_there(tmp_path, flag, inches):
    """Read from the saved files: each PDF's page is the width asked for, and no text of it is set under 7 pt."""
    make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0], "role": [82.0], "em_apl": [81.0]},
             stamp="20250101-000000")
    done = run_cli("report", "--plots", "figures", "--figure-format", "pdf", "--figure-width", flag, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    written = sorted((tmp_path / "figures").iterdir())
    assert len(written) == 4
    for path in written:
        (width, height), sizes = pdf_page_and_font_sizes(path.read_bytes())
        assert width == pytest.approx(inches * 72, abs=0.01) and height > 72, path.name
        assert sizes and min(sizes) >= 7, (path.name, sorted(sizes))


@pytest.mark.parametrize(("value", "expected"), [
    ("wide", "error: --figure-width wide: use column (3.3 in), text (6.9 in) or a width in inches, e.g. 5.5"),
    ("1.5", "error: --figure-width 1.5: use 2 to 24 inches, or column (3.3 in) or text (6.9 in)"),
])
def test_a_figure_width_out_of_range_is_one_line(tmp_path, monkeypatch, capsys, value, expected):
    make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0]}, stamp="20250101-000000")
    code, err = run_main("report", "--plots", "figures", "--figure-width", value, cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and err.strip() == expected and not (tmp_path / "figures").exists()


def test_headings_count_one_loss_as_one(tmp_path):
    make_run(tmp_path, "voc", "finetune", {"bce": [60.0], "an_ls": [40.0]}, stamp="20250101-000000")
    by_loss = {loss: run for (_, loss), run in report.select_newest(report.collect_runs([tmp_path]))[1].items()}
    figure = val_curves.draw(plots.require_matplotlib(), "VOC fine-tuned", by_loss, {"bce"})
    heading = figure.get_suptitle().replace("\n", " ")
    assert "bold: the best single-positive loss by test mAP;" in heading and not re.search(r"best 1\b", heading)
    curves = {name: ([1], [50.0], {}) for name in ["bce", "an", "wan", "l1r", "l2r", "entmin", "epr"]}
    test_map = {name: float(i) for i, name in enumerate(curves)}
    panels, _ = val_curves.panels_for(curves, test_map, set(curves) - {"an"})  # one single-positive loss
    assert [title for title, _ in panels][:2] == ["the best single-positive loss and the best oracle",
                                                   "oracles (1 loss)"]
    for count, said in ((1, "the one loss"), (2, "both losses"), (3, "all 3 losses")):
        curves = {name: [(0.1, 40.0), (0.5, 50.0 + i)] for i, name in enumerate(["an", "role", "epr"][:count])}
        figure = observed_fraction._figure(plots.require_matplotlib(), "VOC linear", curves)
        assert figure.axes[0].get_title().replace("\n", " ").endswith(f"; {said}")
