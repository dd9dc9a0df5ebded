"""`spml-cache check-loss`: every built-in loss meets the contract, and each check fails the loss it is for."""

from __future__ import annotations

import pytest
import torch
from cli_support import REPO, run_cli, run_main

from spml_cache import losses
from spml_cache.losses import contract
from spml_cache.losses.base import Loss, bce, mean_over_entries

CHECKS = len(contract.CHECKS)


@pytest.mark.parametrize("name", losses.names())
def test_every_built_in_loss_passes_every_check(name):
    lines = list(contract.run_checks(losses.get(name)))
    assert [passed for passed, _ in lines] == [True] * CHECKS, lines[-1][1]


def test_the_worked_example_passes_on_the_command_line(tmp_path):
    done = run_cli("check-loss", str(REPO / "examples" / "masked_focal.py") + ":MaskedFocal", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == CHECKS + 2 and all(line.startswith("ok    ") for line in lines[1:-1])
    assert lines[-1].startswith("masked_focal meets the contract")


BROKEN = '''
import torch
from spml_cache.losses import Loss
from spml_cache.losses.base import mean_over_entries


class NaNLoss(Loss):
    name = "nan_loss"

    def forward(self, logits, observed, *, labels=None, index=None):
        return mean_over_entries(torch.log(1 - torch.sigmoid(logits)) * 0 + logits * float("nan"))


class OneNumber(Loss):
    name = "one_number"

    def forward(self, logits, observed, *, labels=None, index=None):
        return torch.nn.functional.softplus(logits).mean()  # one number for every head together
'''


@pytest.mark.parametrize("spec, failure", [
    ("NaNLoss", "FAIL  finite: random logits: the loss is [nan, nan, nan]; compute it from the logits stably"),
    ("OneNumber", "FAIL  finite: random logits: returned shape () for logits [K=3, B, C]; return one value per head"),
])
def test_a_nan_or_wrongly_shaped_loss_fails_with_its_fix(tmp_path, spec, failure):
    (tmp_path / "broken.py").write_text(BROKEN)
    done = run_cli("check-loss", f"broken.py:{spec}", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()  # the first failure, and no check after it
    assert line.startswith(failure), line
    assert done.stdout.strip().splitlines()[1:] == []  # no check passed before the first


class Base(Loss):
    def forward(self, logits, observed, *, labels=None, index=None):
        return mean_over_entries(bce(logits, (observed == 1).to(logits.dtype)))


class Doubled(torch.autograd.Function):
    """The identity whose backward doubles the gradient: a custom backward that disagrees with forward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class WrongGradient(Base):
    name = "wrong_gradient"

    def forward(self, logits, observed, *, labels=None, index=None):
        return super().forward(Doubled.apply(logits), observed)


class ReadsOtherHeads(Base):
    name = "reads_other_heads"

    def forward(self, logits, observed, *, labels=None, index=None):  # every head scaled by the heads' mean
        return super().forward(logits, observed) * torch.sigmoid(logits.mean())


class Branches(Base):
    name = "branches"

    def forward(self, logits, observed, *, labels=None, index=None):
        if (observed == -1).any():  # a host read: a captured step cannot branch on the data
            return super().forward(logits, observed) * 2
        return super().forward(logits, observed)


class Unseeded(Base):
    name = "unseeded"

    def forward(self, logits, observed, *, labels=None, index=None):
        noise = torch.rand(logits.shape[-1], dtype=logits.dtype)  # the global generator, not self.seed
        return super().forward(logits + noise, observed)


class NaNOnNegatives(Base):
    name = "nan_on_negatives"

    def forward(self, logits, observed, *, labels=None, index=None):
        terms = bce(logits, (observed == 1).to(logits.dtype))
        return mean_over_entries(torch.where(observed == -1, logits.log(), terms))  # log of a negative logit


class WrongClosedForm(Base):
    name = "wrong_closed_form"

    def loss_and_grad(self, logits, observed, *, labels=None, index=None):  # twice the slope of forward's terms
        slopes = torch.sigmoid(logits) - (observed == 1).to(logits.dtype)
        return self(logits, observed), 2 * slopes / (observed.shape[-2] * observed.shape[-1])


@pytest.mark.parametrize("check, cls, message", [
    (contract.check_gradient, WrongGradient, "but central finite differences in float64 give"),
    (contract.check_closed_form, WrongClosedForm, "loss_and_grad's gradient differs from autograd of forward"),
    (contract.check_stacked, ReadsOtherHeads, "of 3 stacked heads gets"),
    (contract.check_capture_safe, Branches, "a captured step cannot wait on the device"),
    (contract.check_deterministic, Unseeded, "two builds with the same seed give different values"),
    (contract.check_rules, NaNOnNegatives, "under --observe uniform:pos=1,neg=2: the loss is"),
])
def test_each_check_fails_the_loss_that_breaks_it_and_passes_the_sound_one(check, cls, message):
    with pytest.raises(contract.Failed, match=message):
        check(cls)
    check(type("Sound", (Base,), {"name": "sound"}))  # the same check holds for the loss without the fault


HOST_READ = """
from spml_cache.losses.assume_negative import AssumeNegative


class MarginAN(AssumeNegative):
    name = "margin_an"

    def forward(self, logits, observed, *, labels=None, index=None):
        if logits.abs().max().item() > 1e9:  # a host read in a step
            logits = logits.clamp(-1e9, 1e9)
        return super().forward(logits, observed, labels=labels, index=index)
"""


def test_a_host_read_in_a_plugin_names_the_users_line_first_and_briefly(tmp_path):
    (tmp_path / "margin.py").write_text(HOST_READ)
    done = run_cli("check-loss", "margin.py:MarginAN", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    where = "margin.py:9 (if logits.abs().max().item() > 1e9:  # a host read in a step)"
    assert line.startswith(f"FAIL  capture_safe: epoch 1: Tensor.item at {where}; a captured step cannot"), line
    assert "spml_cache" not in line and len(line) < 400


def test_a_misspelt_class_gets_the_closest_one_the_file_defines_and_no_flag_it_was_not_given(tmp_path, monkeypatch,
                                                                                             capsys):
    (tmp_path / "margin.py").write_text(HOST_READ)
    done = run_cli("check-loss", "margin.py:MarginAn", cwd=tmp_path)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1 and line == ("error: margin.py:MarginAn: margin.py defines no MarginAn (did you mean"
                                             " MarginAN?); name a class it defines (docs/your-own-loss.md)")
    # as a module too, and after --loss where --loss was given
    code, err = run_main("linear", "--dataset", "voc", "--loss", "margin:MarginAn", cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and err.startswith("error: --loss margin:MarginAn: margin defines no MarginAn (did you mean"
                                        " MarginAN?)"), err
    # a name far from any: no guess (AssumeNegative is imported there, not defined)
    code, err = run_main("check-loss", "margin.py:Focal", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "did you mean" not in err and "margin.py defines no Focal" in err
