"""docs/your-own-loop.md runs as written: its loop trains and its loss goes down; the same loop with a loss that keeps
state, relabels from the training logits and changes between epochs (em_apl) keeps the contract (no refusal, no
warning, its pseudo-labels made); the page's table of families is the registry's."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from docs_support import REPO, python_blocks

from spml_cache import losses
from spml_cache.runtime.errors import SpmlError

PAGE = "docs/your-own-loop.md"


def run_page(loss_name: str | None = None) -> dict:
    """The page's Python blocks, in order, in one namespace (with `LOSS` set to `loss_name` if given)."""
    namespace: dict = {}
    for block in python_blocks(PAGE):
        if loss_name is not None:
            block, found = re.subn(r'^LOSS = "\w+"', f'LOSS = "{loss_name}"', block, flags=re.M)
            assert found <= 1
        exec(compile(block, PAGE, "exec"), namespace)
    return namespace


def test_the_pages_loop_trains_and_its_loss_goes_down(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", losses.EpochWarning)
        page = run_page()
    epoch_losses = page["epoch_losses"]
    assert len(epoch_losses) == page["EPOCHS"] >= 3
    assert epoch_losses[-1] < epoch_losses[0], epoch_losses
    assert sum(later < earlier for earlier, later in zip(epoch_losses, epoch_losses[1:])) >= len(epoch_losses) - 2
    assert capsys.readouterr().out.count("epoch ") == page["EPOCHS"]


def test_the_pages_loop_keeps_a_relabelling_losss_contract(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", losses.EpochWarning)
        page = run_page("em_apl")
    loss = page["loss"]
    assert loss.name == "em_apl" and loss.epoch_use.epoch == page["EPOCHS"]
    assert bool(loss.pseudo_negative.any())  # relabelled from train_logits after its warm-up


FAMILIES = {  # the page's family column -> which losses the registry puts in it
    "oracle": lambda cls: cls.oracle,
    "state": lambda cls: bool(cls.state),
    "needs_train_logits": lambda cls: cls.needs_train_logits,
    "needs_start_epoch()": lambda cls: cls.needs_start_epoch(),
    "row_params": lambda cls: bool(cls.row_params),
    "needs_similarity": lambda cls: cls.needs_similarity,
    "penalises_weight": lambda cls: cls.penalises_weight,
    "k": lambda cls: "k" in cls.defaults,
}


def test_the_pages_families_are_the_registrys():
    text = (REPO / PAGE).read_text()
    rows = re.findall(r"^\| [^|]*\(`([^`]+)`[^|]*\) \| ([^|]+) \|", text, flags=re.M)
    assert [family for family, _ in rows] == list(FAMILIES)
    for family, names in rows:
        expected = [name for name in losses.names() if FAMILIES[family](losses.get(name))]
        assert re.findall(r"`(\w+)`", names) == expected, family
    (rest,) = re.findall(r"Every other loss \(([^)]+)\)", text)
    in_a_family = {name for name in losses.names() if any(is_in(losses.get(name)) for is_in in FAMILIES.values())}
    assert re.findall(r"`(\w+)`", rest) == [name for name in losses.names() if name not in in_a_family]


@pytest.mark.parametrize("name", ["vlpl", "gpr"])
def test_a_loss_the_page_leaves_out_says_what_it_needs(name):
    observed = torch.zeros(8, 5, dtype=torch.int8)
    observed[:, 0] = 1
    with pytest.raises(SpmlError, match="needs the cache's text side"):
        losses.build(name, num_classes=5, train_observed=observed)
