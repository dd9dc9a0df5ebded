"""`linear --from RUN`: every head starts from a finished linear run's selected head instead of its seed's init."""

import json
import re

import pytest
import torch
from cli_support import run_cli
from linear_support import quiet, write_synthetic_cache

from spml_cache.linear import run_linear
from spml_cache.runtime.errors import SpmlError

# So small that a head ends its one epoch where it started (to ~1e-9): what it starts from is what best.pt holds.
STILL = [1e-10]



@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=40, val=16, test=20,
                                 classes=4, dim=8)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_cache):
    """A finished run of an and role whose heads have moved far from any seed's init."""
    out = tmp_path_factory.mktemp("runs")
    return run_linear(cache=tiny_cache, losses=["an", "role"], lrs=[1e-1], batch_sizes=[4], epochs=3, out=out,
                      console=quiet())


def best(run) -> dict:
    return torch.load(run.run_dir / "best.pt", weights_only=True)


def test_heads_start_from_the_same_loss_head_of_the_run(tmp_path, tiny_cache, first_run):
    run = run_linear(cache=tiny_cache, losses=["an", "role"], lrs=STILL, batch_sizes=[4, 8], epochs=1, seeds=2,
                     out=tmp_path, from_run=first_run.run_dir, console=quiet())
    before, after = best(first_run), best(run)
    for name in ("an", "role"):
        for key in ("weight", "bias"):
            torch.testing.assert_close(after[name]["head"][key], before[name]["head"][key], rtol=0, atol=1e-6)
    # same loss on the same cache: ROLE's label matrix comes along too
    torch.testing.assert_close(after["role"]["loss_state"]["theta"], before["role"]["loss_state"]["theta"],
                               rtol=0, atol=1e-6)
    started = json.loads((run.run_dir / "config.json").read_text())["from"]
    assert started["role"]["run"] == str(first_run.run_dir) and started["role"]["loss"] == "role"
    assert started["an"]["epoch"] == before["an"]["epoch"]


def test_a_loss_the_run_lacks_starts_from_its_best_single_positive_head(tmp_path, tiny_cache, first_run):
    run = run_linear(cache=tiny_cache, losses="wan", lrs=STILL, batch_sizes=[4], epochs=1, out=tmp_path,
                     from_run=first_run.run_dir, console=quiet())
    trained = first_run.results["losses"]
    best_loss = max(trained, key=lambda name: trained[name]["val_map"])
    torch.testing.assert_close(best(run)["wan"]["head"]["weight"], best(first_run)[best_loss]["head"]["weight"],
                               rtol=0, atol=1e-6)
    assert json.loads((run.run_dir / "config.json").read_text())["from"]["wan"]["loss"] == best_loss


def test_an_oracle_head_is_never_the_fallback(tmp_path, tiny_cache):
    """The full-label bce head would hand a single-positive loss what it must not see."""
    oracle_only = run_linear(cache=tiny_cache, losses="bce", lrs=[1e-1], batch_sizes=[4], epochs=1,
                             out=tmp_path / "oracle", console=quiet())
    with pytest.raises(SpmlError, match="has no head for an and no single-positive head"):
        run_linear(cache=tiny_cache, losses="an", out=tmp_path / "runs", from_run=oracle_only.run_dir, console=quiet())
    assert not (tmp_path / "runs").exists()


def test_without_from_heads_start_from_their_seed(tmp_path, tiny_cache, first_run):
    run = run_linear(cache=tiny_cache, losses="an", lrs=STILL, batch_sizes=[4], epochs=1, out=tmp_path,
                     console=quiet())
    assert not torch.allclose(best(run)["an"]["head"]["weight"], best(first_run)["an"]["head"]["weight"], atol=1e-2)
    assert json.loads((run.run_dir / "config.json").read_text())["from"] is None


def test_theta_stays_behind_on_another_cache(tmp_path, tiny_cache, first_run):
    """Same classes, other training rows: the head fits, ROLE's per-row label matrix does not."""
    other = write_synthetic_cache(tmp_path / "other" / "voc-resnet50-448.h5", train=36, val=16, test=20, classes=4,
                                  dim=8, seed=5)
    done = run_cli("linear", "--cache", str(other), "--loss", "role", "--lr", "1e-10", "--batch-size", "4",
                   "--epochs", "1", "--from", str(first_run.run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # not in silence: one line naming both caches
    trained_on = json.loads((first_run.run_dir / "config.json").read_text())["cache"]
    (line,) = [line for line in done.stderr.splitlines() if "--from" in line]
    assert line.startswith(f"warning: --from {first_run.run_dir}: its heads were trained on {trained_on} (cache ")
    assert f"not on {other} (cache " in line and "without their loss state" in line
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    trained = torch.load(run_dir / "best.pt", weights_only=True)["role"]
    torch.testing.assert_close(trained["head"]["weight"], best(first_run)["role"]["head"]["weight"], rtol=0, atol=1e-6)
    assert trained["loss_state"]["theta"].shape == (1, 36, 4)


@pytest.mark.parametrize("classes, dim, message", [
    (5, 8, "its heads predict 4 classes .* has 5 classes"),
    (4, 6, "from 8-d features, but .* of 6-d features"),
])
def test_a_cache_whose_classes_disagree_with_the_from_head(tmp_path, first_run, classes, dim, message):
    other = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", classes=classes, dim=dim)
    with pytest.raises(SpmlError, match=f"--from {re.escape(str(first_run.run_dir))}: .*{message}.*leave out --from"):
        run_linear(cache=other, losses="an", out=tmp_path / "runs", from_run=first_run.run_dir, console=quiet())
    assert not (tmp_path / "runs").exists()


def test_renamed_classes_are_refused_too(tmp_path, tiny_cache, first_run):
    """Same shape, other class names: the head's outputs would mean other things."""
    run_dir = tmp_path / "renamed"
    run_dir.mkdir()
    for path in first_run.run_dir.iterdir():
        if path.is_file():
            (run_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((run_dir / "config.json").read_text())
    config["classes"] = ["cat", "dog", "cow", "bus"]
    (run_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpmlError, match=r"predict 4 classes \(cat, dog, cow, \.\.\.\)"):
        run_linear(cache=tiny_cache, losses="an", out=tmp_path / "runs", from_run=run_dir, console=quiet())
    assert not (tmp_path / "runs").exists()


def test_from_what_is_not_a_finished_linear_run(tmp_path, tiny_cache, first_run):
    with pytest.raises(SpmlError, match="is not a run directory"):
        run_linear(cache=tiny_cache, losses="an", out=tmp_path / "runs", from_run=tmp_path / "nowhere", console=quiet())
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    with pytest.raises(SpmlError, match="did not finish"):
        run_linear(cache=tiny_cache, losses="an", out=tmp_path / "runs", from_run=unfinished, console=quiet())
    assert not (tmp_path / "runs").exists()


def test_from_on_the_command_line(tmp_path, tiny_cache, first_run):
    done = run_cli("linear", "--cache", str(tiny_cache), "--loss", "an", "--lr", "1e-10", "--batch-size", "4",
                   "--epochs", "1", "--from", str(first_run.run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr  # the same cache: nothing to say
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    torch.testing.assert_close(torch.load(run_dir / "best.pt", weights_only=True)["an"]["head"]["weight"],
                               best(first_run)["an"]["head"]["weight"], rtol=0, atol=1e-6)
    other = write_synthetic_cache(tmp_path / "other" / "voc-resnet50-448.h5", classes=5, dim=8)
    refused = run_cli("linear", "--cache", str(other), "--loss", "an", "--from", str(first_run.run_dir),
                      "--out", "refused", cwd=tmp_path, env={"COLUMNS": "60"})  # one line, however narrow
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith(f"error: --from {first_run.run_dir}: its heads predict 4 classes") and "--from" in line
    assert not (tmp_path / "refused").exists()
