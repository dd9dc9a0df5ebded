"""The readers of a run under several observation rules: the report (one column per rule, the `entry:P` sweep
figure) and fine-tuning (the rule of the head it starts from)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from linear_support import quiet, write_synthetic_cache

from spml_cache import cache, observation, runs
from spml_cache.finetune.settings import FinetuneOptions, FinetuneSettings, Resumed
from spml_cache.finetune.start import starting_point
from spml_cache.linear import run_linear
from spml_cache.observation import parse_rules
from spml_cache.report.collect import collect_runs
from spml_cache.report.observed_fraction import sweep_points
from spml_cache.report.tables import build_table


@pytest.fixture(scope="module")
def rules_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rules")
    tiny = write_synthetic_cache(folder / "voc-resnet50-448.h5", train=48, val=16, test=24, dim=2048)  # finetune checks
    run = run_linear(cache=tiny, losses=["an", "epr"], out=folder / "runs", console=quiet(), lrs=[1e-2],
                     batch_sizes=[8], epochs=2, observe=parse_rules("single,entry:0.2,entry:0.6"))
    return tiny, run.run_dir, runs.load_results(run.run_dir)


def test_report_puts_each_rule_in_a_column_of_its_own(rules_run):
    _, run_dir, results = rules_run
    table = build_table(collect_runs([run_dir]))
    labels = [column.label for column in table.columns]
    assert labels == ["VOC linear", "VOC linear (entry:0.2)", "VOC linear (entry:0.6)"]
    rows = dict(table.rows)
    for loss in ("an", "epr"):
        for label, rule in zip(labels, ("single", "entry:0.2", "entry:0.6")):
            assert rows[loss][label].mean == results["losses"][observation.result_key(loss, rule)]["test_map"]


def test_the_sweep_figure_plots_test_map_against_p(rules_run):
    _, run_dir, results = rules_run
    from spml_cache.report.collect import select_newest

    columns, chosen, _ = select_newest(collect_runs([run_dir]))
    per_column = [(c, {loss: run for (label, loss), run in chosen.items() if label == c.label}) for c in columns]
    ((where, curves),) = sweep_points(per_column).items()
    assert where[:2] == ("voc", "linear")
    for loss in ("an", "epr"):
        assert curves[loss] == [(p, results["losses"][f"{loss}@entry:{p}"]["test_map"]) for p in (0.2, 0.6)]
    assert sweep_points(per_column[:2]) == {}  # one fraction is no sweep


def test_finetune_starts_from_the_head_and_the_rule_it_names(rules_run, tmp_path):
    tiny, run_dir, _ = rules_run
    options = FinetuneOptions(init="best", from_run=run_dir, loss="epr@entry:0.6")
    features, start = starting_point(options, tmp_path, None)
    assert (start.loss, start.rule) == ("epr", "entry:0.6")
    drawn = observation.for_cache(cache.load(tiny), parse_rules("entry:0.6"))["entry:0.6"]
    assert np.array_equal(features.train.observed, drawn.train) and np.array_equal(features.val.observed, drawn.val)
    single, start = starting_point(replace(options, loss="epr"), tmp_path, None)
    assert start.rule == "single" and np.array_equal(single.train.observed, cache.load(tiny).train.observed)


def test_finetune_settings_keep_the_rule_and_an_older_runs_config_still_reads(tmp_path):
    options = FinetuneOptions(init="best", loss="an", dataset="voc", cache=Path("/c.h5"), from_run=Path("/r"),
                              weights="none", resolution=32, epochs=1, lrs=[1e-3], batch_sizes=[8], seeds=1,
                              head_lr_mult=1.0, skip_missing=False, hparams={}, fidelity="exact", decode="cpu")
    settings = FinetuneSettings(options, {})
    assert (settings.loss, settings.rule, settings.key) == ("an", "single", "an")
    under = FinetuneSettings(replace(options, loss="an@entry:0.2"), {})
    assert (under.loss, under.rule, under.key) == ("an", "entry:0.2", "an@entry:0.2")
    stored = under.options.stored()
    assert FinetuneOptions.from_stored(stored) == under.options and stored["loss"] == "an@entry:0.2"
    assert under.options.differences(under.options) == [] and stored["cache"] == str(Path("/c.h5").resolve())
    assert json.loads(json.dumps(stored)) == stored  # config.json keeps it as it is
    facts = {"stage": "finetune", "root": "data", "cache_id": "x"}
    runs.write_json(tmp_path / "config.json", {**facts, **stored})  # each setting once, under its own name
    assert Resumed.read(tmp_path).options == under.options
    older = {**stored, "loss": "an", "rule": "entry:0.2", "seeds": [0]}  # a run's config before options were declared
    runs.write_json(tmp_path / "config.json", {**facts, "options": older})
    assert Resumed.read(tmp_path).options == under.options
