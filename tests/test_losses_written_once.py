"""A simple loss written once (`Loss.equation` over `losses.terms.Terms`): the base class derives `forward` and the
closed form `loss_and_grad` from it. The toy loss of docs/your-own-loss.md (run from the page as written) against a
restatement of its equation and through check-loss; each block's slope against autograd of its value."""

from __future__ import annotations

import re

import pytest
import torch
from cli_support import run_cli, run_main
from docs_support import REPO, python_blocks

from spml_cache import losses
from spml_cache.losses import contract
from spml_cache.losses.base import Loss
from spml_cache.losses.terms import Sloped, Terms

PAGE = "docs/your-own-loss.md"


def documented_loss() -> type[losses.Loss]:
    """The page's `SoftWAN`, from its block as written."""
    (block,) = [block for block in python_blocks(PAGE) if "def equation" in block]
    namespace: dict = {}
    exec(compile(block, PAGE, "exec"), namespace)
    return namespace["SoftWAN"]


def restated(logits: torch.Tensor, observed: torch.Tensor, w: float, ls: float) -> torch.Tensor:
    """SoftWAN's equation restated from its description: nl(p) = -log p on observed positives, w (ls nl(p) +
    (1 - ls) nl(1 - p)) on unobserved entries, nl(1 - p) on observed negatives; the sum over B*C per head."""
    p = torch.sigmoid(logits)
    nl_p, nl_1mp = -torch.log(p), -torch.log1p(-p)
    terms = torch.where(observed == 1, nl_p, torch.where(observed == 0, w * (ls * nl_p + (1 - ls) * nl_1mp), nl_1mp))
    return terms.sum(dim=(-2, -1)) / (logits.shape[-2] * logits.shape[-1])


def test_the_documented_loss_is_written_once_and_has_a_closed_form():
    cls = documented_loss()
    assert "equation" in vars(cls) and "forward" not in vars(cls) and "loss_and_grad" not in vars(cls)
    assert cls.closed_form()


def test_the_documented_loss_is_its_equation_in_value_and_gradient():
    loss = documented_loss()(num_classes=6, num_heads=2, w=0.3, ls=0.2).double()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 6, generator=generator, dtype=torch.float64) * 4
    observed = torch.randint(-1, 2, (9, 6), generator=generator).to(torch.int8)
    z = logits.clone().requires_grad_()
    expected = restated(z, observed, 0.3, 0.2)
    (expected_grad,) = torch.autograd.grad(expected.sum(), z)
    torch.testing.assert_close(loss(logits, observed), expected.detach(), rtol=1e-12, atol=0)
    value, grad = loss.loss_and_grad(logits, observed)
    torch.testing.assert_close(value, expected.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-15)


def test_the_documented_loss_passes_check_loss():
    lines = list(contract.run_checks(documented_loss()))
    assert all(passed for passed, _ in lines) and len(lines) == len(contract.CHECKS), lines[-1][1]
    assert any(line.startswith("loss_and_grad gives forward's value") for _, line in lines)


def test_check_loss_passes_the_documented_loss_on_the_command_line(tmp_path):
    (block,) = [block for block in python_blocks(PAGE) if "def equation" in block]
    (tmp_path / "my_losses.py").write_text(block)
    done = run_cli("check-loss", "my_losses.py:SoftWAN", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("soft_wan meets the contract")


def blocks(x: Terms, observed: torch.Tensor) -> dict:
    """Every block of `x`, and the combinations an equation makes of them."""
    target = torch.rand(x.logits.shape[-2:], generator=torch.Generator().manual_seed(5), dtype=x.dtype)
    return {
        "nl_p": x.nl_p, "nl_1mp": x.nl_1mp, "bce": x.bce(target), "entropy": x.entropy,
        "where": x.where(observed == 1, x.nl_p, x.where(observed == 0, 0.25, x.nl_1mp)),
        "known_or": x.known_or(observed, -0.5 * x.entropy),
        "weighted sum": 0.5 * x.nl_p + x.nl_1mp * (observed == 0),
    }


@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("scale", [3.0, 40.0], ids=["random", "saturated"])
def test_each_blocks_slope_is_autograd_of_its_value(eps, scale):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 5, generator=generator, dtype=torch.float64) * scale
    observed = torch.randint(-1, 2, (7, 5), generator=generator).to(torch.int8)
    z = logits.clone().requires_grad_()
    values = blocks(Terms(z, eps), observed)
    sloped = blocks(Terms(logits, eps, slopes=True), observed)
    for name, value in values.items():
        # entry by entry: a term's slope is its sum's gradient (the blocks share nl_p, nl_1mp: the graph stays)
        (expected,) = torch.autograd.grad(value.sum(), z, retain_graph=True)
        got = sloped[name]
        assert isinstance(got, Sloped) and not got.slope.requires_grad, name
        # 1e-10: the closed form's nl(p) is softplus(-x), which returns -x itself past -x = 20 (off by e^x there)
        torch.testing.assert_close(got.value, value.detach(), rtol=1e-10, atol=0, msg=name)
        torch.testing.assert_close(got.slope, expected, rtol=1e-9, atol=1e-300, msg=name)
    for reduce in ("mean", "per_image_mean"):
        value = getattr(Terms(z, eps), reduce)(values["known_or"] if reduce == "mean" else values["nl_p"].sum(-1))
        (expected,) = torch.autograd.grad(value.sum(), z, retain_graph=True)
        x = Terms(logits, eps, slopes=True)
        per_image = Sloped(sloped["nl_p"].value.sum(-1), sloped["nl_p"].slope)  # d sum_c nl(p_nc) / d x_nc
        got = getattr(x, reduce)(sloped["known_or"] if reduce == "mean" else per_image)
        torch.testing.assert_close(got.value, value.detach(), rtol=1e-10, atol=0, msg=reduce)
        torch.testing.assert_close(got.slope, expected, rtol=1e-9, atol=1e-300, msg=reduce)


def test_a_term_outside_the_blocks_is_refused_in_one_line():
    x = Terms(torch.zeros(2, 3), slopes=True)
    with pytest.raises(TypeError, match="write each term of an equation from the blocks of its Terms"):
        x.where(torch.ones(2, 3, dtype=torch.bool), x.nl_p, torch.sigmoid(x.logits))


def test_rewriting_the_equation_keeps_the_closed_form_and_rewriting_forward_drops_it():
    class Halved(losses.get("em")):
        name = "halved_em"

        def equation(self, x, observed, *, labels=None, index=None):
            return 0.5 * super().equation(x, observed)

    class Forwarded(Halved):
        name = "forwarded_em"

        def forward(self, logits, observed, *, labels=None, index=None):
            return super().forward(logits, observed)

    assert Halved.closed_form() and not Forwarded.closed_form()
    loss = Halved(num_classes=4).double()
    logits, observed = torch.randn(5, 4, dtype=torch.float64), torch.zeros(5, 4, dtype=torch.int8)
    torch.testing.assert_close(loss(logits, observed), 0.5 * losses.build("em", num_classes=4).double()(logits, observed))


def test_a_loss_with_neither_forward_nor_equation_says_what_to_write():
    class Empty(losses.Loss):
        name = "empty"

    assert not Empty.closed_form()
    with pytest.raises(NotImplementedError, match="defines neither forward nor equation"):
        Empty(num_classes=3)(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int8))


def test_a_plugin_with_neither_forward_nor_equation_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.py").write_text("from spml_cache.losses import Loss\n\n\nclass Empty(Loss):\n"
                                       "    name = 'empty_plugin'\n")
    code, err = run_main("check-loss", "empty.py:Empty", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and "Empty has no forward(" in line and "nor equation(x, observed" in line, line


def test_docs_losses_counts_the_losses_written_once():
    written_once = [name for name in losses.names() if losses.get(name).forward is Loss.forward]
    said = re.search(r"(\d+) of the (\d+) losses are written so", (REPO / "docs" / "losses.md").read_text())
    assert said and (int(said.group(1)), int(said.group(2))) == (len(written_once), len(losses.names()))
