"""A linear run's kept parts (linear/parts.py): best states spilled to files of their own, read back as they were,
and a part whose state file is gone trained again."""

from __future__ import annotations

import pytest
import torch

from spml_cache.linear.parts import KeptParts, Part, StoredState
from spml_cache.selection import HeadRecord


def _part(seed: int = 0, batch_size: int = 8) -> Part:
    records = []
    for index, lr in enumerate((1e-2, 1e-3)):
        record = HeadRecord(loss="an", lr=lr, batch_size=batch_size, seed=seed, train_loss=[0.5], val_map=[60.0 + index], test_map=[55.0])
        record.best_epoch, record.best_val_map = 1, 60.0 + index
        generator = torch.Generator().manual_seed(index)
        record.best_state = {"head": {"weight": torch.randn(3, 4, generator=generator), "bias": torch.randn(3)},
                             "loss_state": {}}
        records.append(record)
    records.append(HeadRecord(loss="an", lr=1e-4, batch_size=batch_size, seed=seed, train_loss=[float("nan")], diverged_epoch=1))
    return Part(records, 1.5)


def test_a_kept_part_holds_its_best_states_on_disk_and_reads_them_back(tmp_path):
    kept = KeptParts(tmp_path)
    part = _part()
    weights = [r.best_state["head"]["weight"].clone() for r in part.records[:2]]
    kept.keep("an", 0, 8, part)
    assert [type(r.best_state) for r in part.records] == [StoredState, StoredState, type(None)]
    assert len(list(kept.states.glob("*.pt"))) == 2
    (found,) = kept.read().values()
    assert [r.lr for r in found.records] == [1e-2, 1e-3, 1e-4] and found.seconds == 1.5
    for record, weight in zip(found.records, weights):
        assert isinstance(record.best_state, StoredState)
        assert torch.equal(record.best_state["head"]["weight"], weight)
        assert set(record.best_state) == {"head", "loss_state"}
    assert found.records[2].best_state is None


def test_spill_leaves_stored_states_alone_and_heads_of_other_lrs_apart(tmp_path):
    kept = KeptParts(tmp_path)
    first, second = kept.spill("an", _part()), kept.spill("an@entry:0.5", _part())
    paths = {r.best_state.path for r in first.records + second.records if r.best_state is not None}
    assert len(paths) == 4  # one file per head: rule, lr apart
    again = kept.spill("an", first)
    assert [r.best_state for r in again.records] == [r.best_state for r in first.records]


def test_a_part_whose_state_file_is_gone_is_trained_again(tmp_path):
    kept = KeptParts(tmp_path)
    kept.keep("an", 0, 8, _part())
    kept.keep("an", 0, 16, _part(batch_size=16))
    next(kept.states.glob("*batch16*.pt")).unlink()
    with pytest.warns(UserWarning, match="batch16.pt is damaged .*best state .* is missing"):
        found = kept.read()
    assert list(found) == [("an", 0, 8)]
