"""Names are drawn as written: a class (or loss, or dataset) name with `$` in it is text in every figure, not
matplotlib's mathtext (issue 56: a class `$5-$10` was drawn "5 - 10"; one named `$\\frac{1}{0$` raised a 4-line
ParseException and no figure was written)."""

from __future__ import annotations

import json

import pytest
from cli_support import run_cli
from figure_support import drawn_texts
from test_report import make_run

from spml_cache import report
from spml_cache.report import plots

pytest.importorskip("matplotlib")

TEX_NAMES = ["$5-$10", r"$\frac{1}{0$", r"50% of $x^2$", "plain"]


@pytest.fixture
def tex_run(tmp_path):
    run = make_run(tmp_path / "runs", "voc", "linear", {"an": [60.0], "role": [62.0]}, stamp="20240101-000000")
    config = json.loads((run / "config.json").read_text())
    config["classes"] = TEX_NAMES + config["classes"][len(TEX_NAMES):]
    (run / "config.json").write_text(json.dumps(config))
    return tmp_path, run


def test_report_plots_writes_every_figure_of_classes_named_in_tex(tex_run):
    tmp_path, run = tex_run
    done = run_cli("report", str(run), "--plots", "figures", cwd=tmp_path)
    progress = ("drawing the figures: ", "writing the figures into figures: ")  # the bars' plain lines, off a terminal
    assert done.returncode == 0, done.stderr
    assert all(line.startswith(progress) for line in done.stderr.splitlines()), done.stderr
    written = [line.removeprefix("wrote ") for line in done.stdout.splitlines() if line.startswith("wrote figures/")]
    assert "figures/voc_linear-per_class_ap.png" in written
    assert all((tmp_path / path).stat().st_size > 0 for path in written)


def test_every_name_is_drawn_as_the_text_it_is(tex_run):
    tmp_path, _ = tex_run
    figures = dict(plots.draw_runs(report.collect_runs([tmp_path / "runs"])))
    texts, _, _ = drawn_texts(figures["voc_linear-per_class_ap"])
    drawn = {text.get_text(): text for text, _ in texts}
    for name in TEX_NAMES:
        assert name in drawn, name  # the tick label holds the name itself
        assert drawn[name]._preprocess_math(name) == (name, False), name  # ... and is drawn as plain text


def test_the_mathtext_of_matplotlib_s_own_formatters_stays_mathtext():
    """The report's figures write their log axes' ticks as plain numbers (layout.paper_text), but a figure of the
    report's class keeps what matplotlib's own formatters write as mathtext: a log axis's 10^k tick labels."""
    figure = plots.require_matplotlib()(figsize=(3, 2))
    axes = figure.add_subplot()
    axes.set_yscale("log")
    axes.plot([1, 2, 3], [1, 100, 10_000])
    texts, _, _ = drawn_texts(figure)
    decades = [text for text, _ in texts if text.get_text().startswith(r"$\mathdefault{10^")]
    assert decades and all(text._preprocess_math(text.get_text())[1] for text in decades)
