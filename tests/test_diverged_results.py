"""A loss whose every head turns non-finite after its first epoch: its numbers are those of the epoch before, so
linear names it under its summary and report marks its cell (†), never the best (issue 56). The loss is a real
plugin, `file.py:Class`, whose loss is NaN from epoch 2 on."""

import json

import pytest
from cli_support import run_cli
from linear_support import write_synthetic_cache

NAN_FROM_EPOCH_2 = '''
import math

import torch

from spml_cache.losses import Loss
from spml_cache.losses.base import mean_over_entries, neg_log_1mp, neg_log_p


class NanFromEpoch2(Loss):
    name = "nan_from_2"
    description = "assume negative in epoch 1, NaN from epoch 2"
    reference = "tests/test_diverged_results.py"
    observed_negative = "a known 0"
    poison = 0.0

    def start_epoch(self, epoch, num_epochs, train_logits=None):
        self.poison = math.nan if epoch >= 2 else 0.0

    def forward(self, logits, observed, *, labels=None, index=None):
        terms = torch.where(observed == 1, neg_log_p(logits), neg_log_1mp(logits))
        return mean_over_entries(terms) + self.poison
'''


@pytest.fixture(scope="module")
def diverged_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diverged")
    (folder / "nan_loss.py").write_text(NAN_FROM_EPOCH_2)
    cache_path = write_synthetic_cache(folder / "voc-resnet50-448.h5", train=40, val=16, test=20)
    done = run_cli("linear", "--cache", str(cache_path), "--loss", "nan_loss.py:NanFromEpoch2", "--epochs", "3",
                   cwd=folder)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (folder / "runs" / "voc").iterdir()
    return folder, run_dir, done.stdout


def test_linear_names_a_loss_whose_selected_heads_diverged(diverged_run):
    folder, run_dir, stdout = diverged_run
    result = json.loads((run_dir / "results.json").read_text())["losses"]["nan_from_2"]
    assert len(result["configs"]) > 1 and {config["diverged_epoch"] for config in result["configs"]} == {2}
    assert result["best_epoch"] == [1]  # the selection, as the papers make it, kept epoch 1: what is named
    lines = stdout.splitlines()
    (row,) = [line for line in lines if "nan_from_2" in line and "│" in line]
    assert "1 (diverged at 2)" in row
    assert "nan_from_2: every head diverged (a non-finite loss or score), the selected ones at epoch 2; its numbers"\
           " are epoch 1's, from before: no converged result (try a lower --lr, or check the loss)" in lines


def test_report_marks_a_diverged_result_and_never_calls_it_best(diverged_run):
    folder, run_dir, _ = diverged_run
    done = run_cli("report", str(run_dir), cwd=folder)
    assert done.returncode == 0, done.stderr
    (row,) = [line for line in done.stdout.splitlines() if "nan_from_2" in line and "│" in line]
    assert row.rstrip(" │").endswith("†") and "*" not in row, row
    assert any(line.startswith("† nan_from_2, VOC linear: its selected heads diverged (a non-finite loss or score)"
                               " at epoch 2") for line in done.stdout.splitlines()), done.stdout
    table = json.loads(run_cli("report", str(run_dir), "--format", "json", cwd=folder).stdout)
    (cell,) = table["rows"][0]["cells"].values()
    assert cell["diverged"] == 2 and cell["best"] is False


def test_a_head_that_diverged_outside_the_selected_config_marks_nothing():
    """A grid's too-high lr diverging is the grid doing its work: only the selected config's heads count."""
    from spml_cache.selection import diverged_after_selection, diverged_note

    result = {"selected": {"lr": 0.01, "batch_size": 8}, "best_epoch": [3],
              "configs": [{"lr": 0.01, "batch_size": 8, "seed": 0, "diverged_epoch": None},
                          {"lr": 10.0, "batch_size": 8, "seed": 0, "diverged_epoch": 1}]}
    assert diverged_after_selection(result) is None and diverged_note(result) is None
    result["configs"].append({"lr": 0.01, "batch_size": 8, "seed": 1, "diverged_epoch": 5})  # another seed of it
    assert diverged_after_selection(result) == 5
    assert diverged_note(result).startswith("the selected heads (lr 0.01, batch 8) diverged")
