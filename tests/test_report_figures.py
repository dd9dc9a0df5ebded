"""What `report` shows a reader beyond the numbers: the --paper pairs only where there are published numbers,
losses' names whole at 80 columns, no notes about figures nobody asked for, and figures whose headings fit,
whose one-epoch curves are points at a whole epoch, and which say when one line hides another or which losses
they leave out."""

from __future__ import annotations

import io
import json

from rich.console import Console
from test_report import drawn_figures, make_run, parse_markdown

from spml_cache import losses, report
from spml_cache.linear.live import summary_table
from spml_cache.report import observed_fraction, plots, val_curves
from spml_cache.report.tables import to_markdown

LONG_LABEL = "VOC fine-tuned from ImageNet (entry:0.1) [timm:convnext_base.fb_in22k_ft_in1k_384] authors"


def test_paper_and_difference_only_beside_columns_with_published_numbers(tmp_path):
    make_run(tmp_path, "voc", "linear", {"an": [85.0], "l1r": [80.0]}, stamp="20240101-000000")
    make_run(tmp_path, "voc", "finetune", {"l1r": [81.0]}, stamp="20240102-000000")  # nobody published l1r fine-tuned
    text = to_markdown(report.build_table(report.collect_runs([tmp_path]), paper=True))
    header, rows = parse_markdown(text)
    assert header == ["loss", "VOC linear", "paper", "Δ", "VOC fine-tuned"]
    assert {row[0]: row[1:] for row in rows} == {"AN": ["**85.00**", "84.2", "+0.80", "-"],  # Cole et al. Table 1
                                                 "L1R": ["80.00", "", "", "**81.00**"]}


def lines_holding(text: str, names: list[str]) -> dict[str, bool]:
    return {name: any(f" {name} " in line for line in text.splitlines()) for name in names}


def test_losses_names_stay_whole_in_tables_at_80_columns(tmp_path):
    names = losses.names(similarity=False)
    make_run(tmp_path, "voc", "linear", {name: [50.0 + i] for i, name in enumerate(names)}, stamp="20240101-000000")
    make_run(tmp_path, "voc", "finetune", {"an_ls": [40.0], "role": [41.0]}, stamp="20240102-000000")
    console = Console(file=io.StringIO(), width=80)
    report.print_report([tmp_path], paper=True, console=console)
    oracles = {"bce", "bce_ls", "iun"}
    shown = [f"{losses.display_name(name)} (oracle)" if name in oracles else losses.display_name(name) for name in names]
    assert all(len(line) <= 80 for line in console.file.getvalue().splitlines())
    assert lines_holding(console.file.getvalue(), shown) == dict.fromkeys(shown, True)
    keys = ["an", "bce_observed@largest", "an_ls_neg@entry:0.1", "role@uniform:pos=1,neg=all"]
    result = {"val_map": 70.1, "test_map": 71.2, "selected": {"lr": 1e-3, "batch_size": 16}, "best_epoch": [12],
              "seconds": 12.3, "per_seed": [{}]}
    console = Console(file=io.StringIO(), width=80)
    console.print(summary_table({"losses": dict.fromkeys(keys, result)}))
    assert lines_holding(console.file.getvalue(), keys) == dict.fromkeys(keys, True)
    assert "12.3 s" in console.file.getvalue()  # the short values whole too


def test_plots_say_nothing_of_figures_not_asked_for_and_once_of_one_asked_for(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "voc", "linear", {"an": [84.0], "role": [86.0]}, stamp="20240101-120000")
    make_run(root, "coco", "linear", {"an": [60.0]}, stamp="20240101-120000")  # one loss: no per-class pair
    for compare, expected in ((None, []), ("an,role", ["no per_class_ap figure of an vs role for COCO linear"])):
        console = Console(file=io.StringIO(), width=400)
        report.report_command(report.ReportOptions([], runs_root=root, compare=compare, plots_dir=tmp_path / "figures"),
                              console)
        said = [line for line in console.file.getvalue().splitlines() if not line.startswith("wrote ")]
        assert [line.split(" (")[0] for line in said if "figure" in line] == expected


def text_boxes(figure):
    """The drawn extents (pixels) of the figure's suptitle and of every panel's title that has text."""
    figure.savefig(io.BytesIO(), format="png", dpi=100)
    titles = [axes.title for axes in figure.axes if axes.get_title()]
    heading = [figure._suptitle] if figure._suptitle is not None else []
    return [text.get_window_extent() for text in heading], [text.get_window_extent() for text in titles]


def assert_headings_fit(figure):
    headings, titles = text_boxes(figure)
    width, height = figure.bbox.width, figure.bbox.height
    for box in headings + titles:  # nothing cut off at the figure's edges
        assert box.x0 >= 0 and box.x1 <= width and box.y0 >= 0 and box.y1 <= height, (box, width, height)
    for heading in headings:  # and no panel's title under the suptitle
        assert all(title.y1 <= heading.y0 for title in titles), (heading, titles)


def test_every_figure_heading_fits_with_a_long_column_label(tmp_path):
    make_run(tmp_path, "voc", "linear", {"an": [84.0], "role": [86.0]}, stamp="20240101-120000")
    figures = drawn_figures(tmp_path, "VOC linear")
    by_loss = {loss: run for (label, loss), run in report.select_newest(report.collect_runs([tmp_path]))[1].items()}
    Figure = plots.require_matplotlib()
    summaries = {loss: plots._train_summary(run, loss) for loss, run in by_loss.items()}
    for figure in [
        val_curves.draw(Figure, LONG_LABEL, by_loss, set()),
        plots._per_class_ap(Figure, LONG_LABEL, by_loss, ("an", "role")),
        plots._train_histograms(Figure, LONG_LABEL, summaries),
        plots._label_recovery(Figure, LONG_LABEL, by_loss, summaries),
        *figures.values(),
    ]:
        assert_headings_fit(figure)


def test_a_one_epoch_curve_is_a_point_at_its_epoch(tmp_path):
    run = make_run(tmp_path, "voc", "finetune", {"an_ls": [40.0], "role": [41.0]}, stamp="20240101-120000")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines if line["epoch"] == 1))
    figure = drawn_figures(tmp_path, "VOC fine-tuned")["val_curves"]
    figure.savefig(io.BytesIO(), format="png")
    (axes,) = figure.axes
    low, high = axes.get_xlim()
    assert low <= 0.5 and high >= 1.5  # room either side of the point
    assert [tick for tick in axes.get_xticks() if low <= tick <= high] == [1]  # ticks at whole epochs only
    assert all(line.get_marker() == "o" for line in axes.get_lines())
    assert "one epoch: one point per loss" in figure.get_suptitle().replace("\n", " ")


def test_a_loss_whose_curve_repeats_another_is_drawn_dotted_and_says_whose(tmp_path):
    run = make_run(tmp_path, "voc", "linear", {"an": [50.0], "zlpr": [60.0], "opml": [61.0]}, stamp="20240101-120000")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    zlpr = {(line["lr"], line["seed"], line["epoch"]): line["val_map"] for line in lines if line["loss"] == "zlpr"}
    for line in lines:  # opml at its defaults is zlpr: the same validation curve
        if line["loss"] == "opml":
            line["val_map"] = zlpr[(line["lr"], line["seed"], line["epoch"])]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    figure = drawn_figures(tmp_path, "VOC linear")["val_curves"]
    (axes,) = figure.axes
    styles = {line.get_label().split(":")[0].split()[-1]: (line.get_linestyle(), " ".join(line.get_label().split()))
              for line in axes.get_lines()}  # a legend entry may be wrapped to its panel's width
    assert styles["OPML"][0] == ":" and styles["OPML"][1].endswith("same curve as ZLPR")
    assert styles["ZLPR"][0] == "-" and styles["AN"][0] == "-" and "same curve" not in styles["AN"][1]
    assert "dotted: the same curve as an earlier loss" in figure.get_suptitle().replace("\n", " ")
    curves = {"a": ([1, 2], [3.0, 4.0]), "b": ([1, 2], [3.0, 4.5]), "c": ([1, 2], [3.0, 4.0])}
    assert val_curves.repeats(curves) == {"c": "a"}  # c repeats a exactly; b differs at its last epoch


def test_the_observed_fraction_figure_names_the_losses_it_leaves_out():
    names = losses.names(similarity=False)[:14]
    curves = {name: [(0.1, 40.0 + i), (0.5, 50.0 + i)] for i, name in enumerate(names)}
    figure = observed_fraction._figure(plots.require_matplotlib(), "VOC linear", curves)
    title = figure.axes[0].get_title().replace("\n", " ")
    best_last = [losses.display_name(name) for name in names[::-1]]  # the highest mAP at the largest fraction first
    assert f"the best {observed_fraction.SHOWN} of 14 losses at P = 0.5" in title
    assert title.endswith(f"(left out: {', '.join(best_last[observed_fraction.SHOWN:])})")
    assert [line.get_label() for line in figure.axes[0].get_lines()] == best_last[:observed_fraction.SHOWN]
    assert_headings_fit(figure)


def test_the_observed_fraction_figure_says_all_when_it_shows_all():
    curves = {name: [(0.1, 40.0), (0.5, 50.0 + i)] for i, name in enumerate(losses.names()[:3])}
    figure = observed_fraction._figure(plots.require_matplotlib(), "VOC linear", curves)
    assert figure.axes[0].get_title().replace("\n", " ").endswith("; all 3 losses")
