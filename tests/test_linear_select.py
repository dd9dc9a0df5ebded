"""Selection (docs/protocol.md): best val epoch per head (strictly greater replaces), best config by val mAP
(mean over seeds), test mAP at that epoch; mean ± std over seeds."""

import numpy as np
import pytest

from spml_cache.selection import HeadRecord, loss_results, select_config


def record(lr, seed, val, test, diverged=None):
    head = HeadRecord(loss="an", lr=lr, batch_size=8, seed=seed)
    for epoch, (v, t) in enumerate(zip(val, test), start=1):
        head.add_epoch(epoch, 0.5, v, t, np.full(3, t / 100))
    head.diverged_epoch = diverged
    return head


def test_best_epoch_is_the_first_maximum():
    head = record(1e-2, 0, [50, 60, 60, 55, 60], [40, 45, 47, 41, 49])
    assert head.best_epoch == 2  # epochs 3 and 5 tie with 60: strictly greater replaces
    assert head.best_val_map == 60
    np.testing.assert_allclose(head.best_test_ap, 0.45)
    assert record(1e-2, 0, [float("nan"), 10], [1, 2]).best_epoch == 2  # NaN never selected


def test_config_by_mean_val_over_seeds_and_test_at_each_best_epoch():
    heads = [
        # grid order: lr 1e-2, 1e-3, 1e-4, 1e-5
        record(1e-2, 0, [50, 60, 60, 55], [40, 45, 47, 41]),  # best epoch 2: val 60, test 45
        record(1e-3, 0, [58, 59, 61, 61], [30, 31, 90, 91]),  # best epoch 3: val 61
        record(1e-4, 0, [61], [99]),  # mean val 61: ties with 1e-2, which comes first in the grid
        record(1e-5, 0, [], [], diverged=1),  # diverged in its first epoch: never selected
        record(1e-2, 1, [62, 62, 50], [50, 80, 10]),  # best epoch 1: val 62, test 50
        record(1e-3, 1, [57, 58, 59], [30, 30, 30]),
        record(1e-4, 1, [61], [99]),
        record(1e-5, 1, [70], [70]),  # best of seed 1, but its seed 0 diverged: mean -inf
    ]
    selection = select_config(heads)
    assert (selection.lr, selection.batch_size) == (1e-2, 8)
    assert selection.mean_val_map == pytest.approx(61)
    assert selection.representative.seed == 1  # the better val of the two seeds goes to best.pt
    result = loss_results(heads, selection, {"alpha": 0.1}, train_maps=[70.0, 72.0], seconds=1.5)
    assert result["selected"] == {"lr": 1e-2, "batch_size": 8, "hparams": {"alpha": 0.1}}
    assert result["best_epoch"] == [2, 1]
    assert result["val_map"] == pytest.approx(61) and result["val_map_std"] == pytest.approx(1.0)
    assert result["test_map"] == pytest.approx(47.5) and result["test_map_std"] == pytest.approx(2.5)
    assert result["train_map"] == pytest.approx(71)
    np.testing.assert_allclose(result["per_class_ap"], [47.5] * 3)
    assert [s["test_map"] for s in result["per_seed"]] == [45, 50]
    diverged = [c for c in result["configs"] if c["diverged_epoch"] == 1]
    assert diverged == [{"lr": 1e-5, "batch_size": 8, "seed": 0, "best_epoch": None, "val_map": None,
                         "test_map": None, "diverged_epoch": 1}]
    assert len(result["configs"]) == len(heads)


def test_every_head_diverged_gives_no_selection():
    heads = [record(1e-2, 0, [], [], diverged=1)]
    assert select_config(heads) is None
    assert loss_results(heads, None, {}, [], 0.1)["selected"] is None
