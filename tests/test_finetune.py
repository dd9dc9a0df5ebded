"""Stage three (`spml-cache finetune`): LinearInit, ROLE's theta hand-over, selection, resume, data parallel,
bad inputs.

One tiny world for the whole module: the synthetic VOC-layout dataset, a saved random ResNet-50 (so that the
extractor and the fine-tuner load the same trunk), a real cache at 32 px, a real linear run, and one
fine-tuning run through the command line that the resume and data-parallel runs must reproduce. Training runs
single-threaded (OMP_NUM_THREADS=1, torch.set_num_threads(1)) so that every run does the same arithmetic.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision
from cli_support import run_cli
from PIL import Image
from rich.console import Console
from sklearn.metrics import average_precision_score

from spml_cache import cache, extract, finetune, linear, losses, metrics, runs, selection
from spml_cache.backbones.checkpoints import RandomWeightsWarning
from spml_cache.demo import data as demo_data
from spml_cache.finetune import images as data, parallel
from spml_cache.finetune import run as finetune_run
from spml_cache.finetune.model import initial_model
from spml_cache.finetune.settings import FinetuneOptions, resolve
from spml_cache.finetune.start import role_theta_handover
from spml_cache.runtime.errors import Interrupted, SpmlError
from spml_cache.runtime.ranks import Ranks

RESOLUTION = 32
RUN_ARGS = ["--lr", "1e-4", "--batch-size", "4", "--epochs", "2", "--workers", "0", "--device", "cpu"]


class Stop(Exception):
    """Raised from inside a run once the test has seen what it came for."""


def write_linear_run(path: Path, cache_path: Path, heads: dict[str, dict], cache_id: str | None = None,
                     **config) -> Path:
    """A finished linear run directory by hand, per docs/internals.md (for heads no real run would give);
    `cache_id`: the id of the cache it claims to come from (default: `cache_path`'s); `config`: config.json's
    entries to change."""
    path.mkdir(parents=True)
    cache_id = cache_id or cache.cache_id(cache.load(cache_path).attrs)
    runs.write_json(path / "config.json", {"stage": "linear", "dataset": "voc", "cache": str(cache_path),
                                           "cache_id": cache_id, **config})
    torch.save({loss: {"head": head, "loss_state": {}, "lr": 1e-3, "batch_size": 8, "seed": 0, "epoch": 1,
                       "hparams": {}} for loss, head in heads.items()}, path / "best.pt")
    entries = {loss: {"val_map": 10.0, "selected": {"lr": 1e-3, "batch_size": 8, "hparams": {}}} for loss in heads}
    runs.write_json(path / "results.json", {"stage": "linear", "dataset": "voc", "cache_id": cache_id,
                                            "complete": True, "losses": entries})
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):
    base = tmp_path_factory.mktemp("finetune")
    root = demo_data.make_demo_data(base / "data", num_train=16, num_test=6, size=40, seed=0)
    torch.manual_seed(0)
    weights = base / "random-resnet50.pth"
    # Zero-initialised residual branches keep a random ResNet-50 well conditioned: at 32 px the last blocks
    # normalise over a handful of values, and a default random init turns float rounding into 0.1 % logit noise.
    torch.save(torchvision.models.resnet50(zero_init_residual=True).state_dict(), weights)
    cache_path = extract.extract("voc", root, out=base / "voc.h5", weights=str(weights), resolution=RESOLUTION,
                                 batch_size=8, workers=0, device="cpu").path
    runs_dir = base / "runs"
    # An older linear run with other heads: LinearInit must take the newest one.
    classes = len(cache.load(cache_path).classes)
    decoy = {"weight": torch.ones(classes, 2048), "bias": torch.zeros(classes)}
    write_linear_run(runs_dir / "voc" / "linear-all-20000101-000000", cache_path, {"role": decoy, "em_apl": decoy})
    newest = linear.run_linear(cache=cache_path, losses=["role", "em_apl"], lrs=[1e-3], batch_sizes=[4], epochs=2,
                               out=runs_dir, device="cpu", console=Console(file=io.StringIO())).run_dir
    return SimpleNamespace(base=base, root=root, weights=weights, cache=cache_path, runs=runs_dir, linear=newest,
                           features=cache.load(cache_path))


def common(world, **overrides) -> dict:
    options = dict(root=world.root, weights=str(world.weights), lrs=[1e-4], batch_sizes=[4], epochs=2, workers=0,
                   device="cpu", out=world.runs, cache_dir=world.base)
    return {**options, **overrides}


@pytest.fixture(scope="module")
def cli_run(world):
    """The reference run: the command line, LinearInit from the newest linear run of role on voc."""
    args = ["finetune", "--init", "best", "--dataset", "voc", "--loss", "role", "--root", str(world.root),
            "--weights", str(world.weights), "--out", str(world.runs), *RUN_ARGS]
    done = run_cli(*args, cwd=world.base, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    run_dir = Path(done.stdout.strip().splitlines()[-1].split("-> ")[-1])
    return SimpleNamespace(stdout=done.stdout, run_dir=run_dir, metrics=runs.read_metrics(run_dir),
                           results=runs.read_json(run_dir / "results.json"))


def stop(*args, **kwargs):
    raise Stop


def head_logits(run_dir: Path, loss: str, features: np.ndarray) -> np.ndarray:
    head = torch.load(run_dir / "best.pt", weights_only=True)[loss]["head"]
    return features.astype(np.float64) @ head["weight"].numpy().T.astype(np.float64) + head["bias"].numpy()


def test_linear_init_starts_from_the_newest_runs_head(world, monkeypatch):
    """The untrained model's eval-mode logits on the training images = the chosen head on the cached features."""
    seen = {}

    def capture(self, epoch, num_epochs, train_logits=None):
        seen.update(epoch=epoch, logits=train_logits)
        raise Stop

    monkeypatch.setattr(losses.get("em_apl"), "start_epoch", capture)
    lines = []
    with pytest.raises(Stop):
        finetune.finetune(init="best", dataset="voc", loss="em_apl", log=lines.append, **common(world))
    assert lines[0].startswith(f"LinearInit from {world.linear}: the em_apl head")
    assert seen["epoch"] == 1 and seen["logits"].shape == (1, *world.features.train.labels.shape)
    expected = head_logits(world.linear, "em_apl", world.features.train.features)
    np.testing.assert_allclose(seen["logits"][0].numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_role_theta_is_handed_over_as_clipped_logits(world, monkeypatch):
    seen = {}

    def capture(self, epoch, num_epochs, train_logits=None):
        seen["theta"] = self.theta.detach().clone()
        raise Stop

    monkeypatch.setattr(losses.get("role"), "start_epoch", capture)
    with pytest.raises(Stop):
        finetune.finetune(init="best", from_run=world.linear, loss="role", **common(world))
    theta = torch.load(world.linear / "best.pt", weights_only=True)["role"]["loss_state"]["theta"].numpy()
    q = np.clip(1 / (1 + np.exp(-theta.astype(np.float64))), 1e-5, 1 - 1e-5)
    np.testing.assert_allclose(seen["theta"].numpy(), np.log(q / (1 - q)), rtol=1e-5, atol=1e-5)
    extreme = torch.tensor([[-40.0, -3.0, 0.0, 2.5, 40.0]])
    bound = np.log((1 - 1e-5) / 1e-5)
    np.testing.assert_allclose(role_theta_handover(extreme).numpy(), [[-bound, -3.0, 0.0, 2.5, bound]], rtol=1e-5)


def test_cli_run_names_its_start_and_selects_the_best_val_epoch(world, cli_run):
    assert cli_run.stdout.splitlines()[0] == (
        f"LinearInit from {world.linear}: the role head (lr 0.001, batch size 4, seed 0, epoch "
        f"{torch.load(world.linear / 'best.pt', weights_only=True)['role']['epoch']}, val mAP "
        f"{runs.read_json(world.linear / 'results.json')['losses']['role']['val_map']:.2f})")
    names = {p.name for p in cli_run.run_dir.iterdir()}
    assert names == {"config.json", "env.json", "metrics.jsonl", "results.json", "best.pt", "scores", "labels.npz",
                     "test_labels.npz"}
    kept = runs.read_stored_test(cli_run.run_dir, "role")  # every seed's test scores, for report's F1 family and --ci
    assert kept.seeds == [0] and kept.scores.shape == (1, *kept.labels.shape)
    assert 100 * metrics.average_precision(torch.from_numpy(kept.scores[0]), kept.labels).mean().item() == \
        pytest.approx(cli_run.results["losses"]["role"]["test_map"], abs=1e-4)
    assert [m["epoch"] for m in cli_run.metrics] == [0, 1, 2]  # epoch 0: the start, never selected
    trained = cli_run.metrics[1:]
    best = 0  # the first epoch of the highest val mAP: a later one replaces it only when strictly greater
    for i, line in enumerate(trained):
        if line["val_map"] > trained[best]["val_map"]:
            best = i
    role = cli_run.results["losses"]["role"]
    assert role["best_epoch"] == [best + 1]
    assert role["val_map"] == pytest.approx(trained[best]["val_map"])
    assert role["test_map"] == pytest.approx(trained[best]["test_map"])


def test_epoch_0_scores_the_start_as_the_linear_run_did(world, cli_run):
    """LinearInit's model before any step is the linear run's role head on the trunk that made the cache: scored
    from the images on the same device, it gives that run's val and test mAP (within 0.1)."""
    linear_role = runs.read_json(world.linear / "results.json")["losses"]["role"]
    tuned = cli_run.results["losses"]["role"]
    start = tuned["start"]
    assert start["val_map"] == pytest.approx(linear_role["val_map"], abs=0.1)
    assert start["test_map"] == pytest.approx(linear_role["test_map"], abs=0.1)
    first = cli_run.metrics[0]
    assert first["train_loss"] is None and [first["val_map"], first["test_map"]] == [start["val_map"], start["test_map"]]
    assert (f"seed 0 epoch 0/2 (the starting model, before any step): val mAP {start['val_map']:.2f}, test mAP"
            f" {start['test_map']:.2f}") in cli_run.stdout
    assert tuned["below_start"] == (tuned["test_map"] < start["test_map"])
    assert ("below its start" in cli_run.stdout) == tuned["below_start"]
    best = -float("inf")  # each trained epoch's line: "best so far" only where it is, epoch 0 counted
    for line in cli_run.metrics[1:]:
        said = next(text for text in cli_run.stdout.splitlines() if f"epoch {line['epoch']}/2: train loss" in text)
        selected, best = line["val_map"] > best, max(best, line["val_map"])
        assert said.endswith("(best so far)") == (selected and line["val_map"] >= start["val_map"]), said
        assert said.endswith(f"below the starting model's val mAP {start['val_map']:.2f})") == (
            selected and line["val_map"] < start["val_map"]), said


def test_an_epoch_below_the_start_is_not_called_the_best_so_far():
    """Fine-tuning selects among its trained epochs (epoch 0, the start, is never taken): the first epoch is the
    best of them, but below a better start it is not the best so far (the demo said so after epoch 0's 44.82)."""
    record = selection.HeadRecord(loss="an", lr=1e-5, batch_size=8, seed=0, start={"val_map": 44.82, "test_map": 38.6})
    record.add_epoch(1, 0.48, 12.75, 10.17, np.zeros(3))
    assert finetune_run.best_note(record, 1) == " (the best trained epoch so far; below the starting model's val mAP 44.82)"
    record.add_epoch(2, 0.40, 50.0, 41.0, np.zeros(3))
    assert (finetune_run.best_note(record, 2), finetune_run.best_note(record, 1)) == (" (best so far)", "")
    record.add_epoch(3, 0.38, 49.0, 40.0, np.zeros(3))
    assert finetune_run.best_note(record, 3) == ""  # not selected: nothing said


def sklearn_map(scores: np.ndarray, labels: np.ndarray) -> float:
    aps = [average_precision_score(labels[:, c], scores[:, c]) if labels[:, c].any() else 0.0
           for c in range(labels.shape[1])]
    return 100 * float(np.mean(aps))


def test_best_pt_is_the_model_of_the_best_epoch(world, cli_run):
    """best.pt holds the whole model; scored independently it gives the reported val and test mAP."""
    saved = torch.load(cli_run.run_dir / "best.pt", weights_only=True)["role"]
    net = torchvision.models.resnet50()
    net.fc = torch.nn.Linear(2048, len(world.features.classes))
    state = {k.removeprefix("trunk."): v for k, v in saved["model"].items() if k.startswith("trunk.")}
    net.load_state_dict({**state, "fc.weight": saved["model"]["head.weight"], "fc.bias": saved["model"]["head.bias"]})
    net.eval()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    role = cli_run.results["losses"]["role"]
    for split, reported in (("val", role["val_map"]), ("test", role["test_map"])):
        part = getattr(world.features, split)
        images = [np.asarray(Image.open(world.root / i).convert("RGB")) for i in part.ids]
        batch = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)
        resized = torch.nn.functional.interpolate(batch, size=(RESOLUTION, RESOLUTION), mode="bilinear", antialias=True)
        with torch.no_grad():
            scores = torch.sigmoid(net((resized.float() / 255 - mean) / std)).numpy()
        assert sklearn_map(scores, part.labels) == pytest.approx(reported, abs=1e-3)


def test_resume_after_a_kill_equals_the_uninterrupted_run(world, cli_run, monkeypatch):
    appended = runs.append_metrics

    def killed_after_first_epoch(run_dir, rows):
        appended(run_dir, rows)
        if any(row["epoch"] >= 1 for row in rows):  # not at epoch 0's line, written before any step
            raise KeyboardInterrupt

    monkeypatch.setattr(runs, "append_metrics", killed_after_first_epoch)
    out = world.base / "resumed"
    with pytest.raises(Interrupted) as stopped:
        finetune.finetune(init="best", from_run=world.linear, loss="role", **common(world, out=out))
    monkeypatch.setattr(runs, "append_metrics", appended)
    (run_dir,) = (out / "voc").iterdir()
    assert stopped.value.command == f"spml-cache finetune --resume {run_dir}" and "checkpoints" in stopped.value.kept
    assert not (run_dir / "results.json").exists() and list(run_dir.glob("checkpoints/*.pt"))
    with pytest.raises(SpmlError, match=r"--epochs 3 contradicts the run's 2 .*leave out --epochs"):
        finetune.finetune(resume=run_dir, epochs=3, root=world.root, workers=0, device="cpu")
    finetune.finetune(resume=run_dir, root=world.root, workers=0, device="cpu")
    assert_same_run(run_dir, cli_run)
    with pytest.raises(SpmlError, match="already complete"):
        finetune.finetune(resume=run_dir, root=world.root, workers=0, device="cpu")


def assert_same_run(run_dir: Path, reference, tolerance: float = 1e-6) -> None:
    """Same metrics (up to `tolerance`) and the same best epoch; at rounding-level tolerance also the same best
    model. Above it (two processes) the weights are not compared: Adam turns the sign of a gradient that rounding
    flips into a whole step, so how many weights move by a learning rate is float noise, not a property of the
    code (test_two_gloo_processes_compute_the_single_process_gradient pins the gradients)."""
    metrics = runs.read_metrics(run_dir)
    assert [(m["epoch"], m["lr"], m["batch_size"]) for m in metrics] == [
        (m["epoch"], m["lr"], m["batch_size"]) for m in reference.metrics]
    for got, want in zip(metrics, reference.metrics):
        for key in ("train_loss", "val_map", "test_map"):
            assert got[key] == (None if want[key] is None else pytest.approx(want[key], rel=1e-4, abs=tolerance)), key
    got = torch.load(run_dir / "best.pt", weights_only=True)["role"]
    want = torch.load(reference.run_dir / "best.pt", weights_only=True)["role"]
    assert got["epoch"] == want["epoch"]
    tensors = [(got["model"][k], want["model"][k]) for k in want["model"] if want["model"][k].is_floating_point()]
    tensors.append((got["loss_state"]["theta"], want["loss_state"]["theta"]))
    if tolerance <= 1e-6:
        for a, b in tensors:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def free_port() -> int:
    with socket.socket() as probe:  # a free port for the process group's rendezvous
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _finetune_process(rank: int, world: int, port: int, options: dict) -> None:
    """One process of a data-parallel run, with the environment torchrun gives it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    finetune.finetune(**options)


def test_two_processes_give_the_single_process_run(world, cli_run, tmp_path):
    """`torchrun --nproc-per-node 2 -m spml_cache finetune ...` on the CPU (gloo), as torchrun would start it.
    Spawned, not forked: forking is unsafe once this process has used CUDA or autograd's device threads (on a
    GPU machine the suite has)."""
    options = dict(init="best", from_run=world.linear, loss="role", **common(world, out=tmp_path))
    torch.multiprocessing.start_processes(_finetune_process, args=(2, free_port(), options), nprocs=2,
                                          start_method="spawn")
    (run_dir,) = (tmp_path / "voc").iterdir()
    assert runs.read_json(run_dir / "config.json")["processes"] == 2
    assert_same_run(run_dir, cli_run, tolerance=1e-3)


def test_no_linear_run_says_which_command_makes_one(world, tmp_path):
    with pytest.raises(SpmlError, match=r"no finished linear run of loss an for voc .*: create one with"
                                        r" `spml-cache linear --loss an"):
        finetune.finetune(init="best", dataset="voc", loss="an", **common(world, out=tmp_path))
    assert list(tmp_path.iterdir()) == []


def runs_of_two_backbones(world, folder: Path) -> tuple[Path, Path]:
    """Two finished linear runs of `an` for voc with heads of the same shape: one on the world's cache, a newer
    one on a cache of another backbone (another id and file)."""
    shape = (len(world.features.classes), world.features.train.features.shape[1])
    head = {"an": {"weight": torch.zeros(shape), "bias": torch.zeros(shape[0])}}
    ours = write_linear_run(folder / "voc" / "linear-an-20000101-000000", world.cache, head)
    theirs = write_linear_run(folder / "voc" / "linear-an-20000102-000000", world.cache, head,
                              cache_id="voc-timm_resnet18-32-0000", cache=str(world.base / "voc-timm_resnet18-32.h5"))
    return ours, theirs


def test_init_best_by_dataset_refuses_runs_of_different_caches_as_linear_refuses_caches(world, tmp_path):
    """`finetune --dataset voc` must not start from the newest run of whichever backbone: it names the runs'
    caches and asks for --cache or --from, as `linear --dataset voc` does with several caches."""
    ours, theirs = runs_of_two_backbones(world, tmp_path)
    with pytest.raises(SpmlError, match=r"linear runs of an for voc were made from 2 different caches \(newest of"
                                        rf" each: {ours.name} \(voc.h5\), {theirs.name} \(voc-timm_resnet18-32.h5\)\):"
                                        r" pick one with --cache PATH or --from RUN"):
        finetune.finetune(init="best", dataset="voc", loss="an", **common(world, out=tmp_path))
    assert sorted(path.name for path in (tmp_path / "voc").iterdir()) == [ours.name, theirs.name]  # nothing new
    own_cache = cache.cache_id(world.features.attrs)
    assert runs.newest_run(tmp_path, "voc", "linear", loss="an", cache=own_cache) == ours  # --cache: its runs only


def test_a_run_of_another_cache_is_refused_even_with_heads_that_fit(world, tmp_path):
    _, theirs = runs_of_two_backbones(world, tmp_path)
    with pytest.raises(SpmlError, match=rf"--from {theirs}: its heads were trained on .*voc-timm_resnet18-32.h5"
                                        rf" \(cache voc-timm_resnet18-32-0000\), not on {world.cache}"):
        finetune.finetune(init="best", from_run=theirs, cache=world.cache, **common(world, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_head_of_another_class_count_is_refused(world, tmp_path):
    bad = write_linear_run(tmp_path / "voc" / "linear-an-20000101-000000", world.cache,
                           {"an": {"weight": torch.zeros(21, 2048), "bias": torch.zeros(21)}})
    with pytest.raises(SpmlError, match=r"the an head is \[21, 2048\] but .* has 20 classes"):
        finetune.finetune(init="best", from_run=bad, **common(world, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_head_of_another_dataset_with_as_many_classes_is_refused(world, tmp_path):
    count = len(world.features.classes)
    other = write_linear_run(tmp_path / "nus" / "linear-an-20000101-000000", world.cache,
                             {"an": {"weight": torch.zeros(count, 2048), "bias": torch.zeros(count)}},
                             dataset="nus", classes=[f"tag{i}" for i in range(count)])
    with pytest.raises(SpmlError, match=rf"--from {other}: its heads were trained on nus \(tag0, tag1, tag2, ...\)"
                                        rf" but {world.cache} holds voc \(aeroplane, "):
        finetune.finetune(init="best", from_run=other, **common(world, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_root_that_is_not_there_or_holds_none_of_the_images_says_so_not_skip_missing(world, tmp_path):
    """Every image missing is a wrong --root, not lost files: no --skip-missing hint (it would leave nothing)."""
    args = ["finetune", "--from", str(world.linear), "--loss", "role", "--weights", str(world.weights),
            "--out", str(tmp_path / "out"), *RUN_ARGS]
    done = run_cli(*args, "--root", str(tmp_path / "nowhere"), cwd=tmp_path)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1 and line == (f"error: the image root {tmp_path / 'nowhere'} does not exist: pass"
                                             " --root DIR, the folder the cache was extracted from (its voc images)")
    (tmp_path / "empty").mkdir()
    total = sum(len(getattr(world.features, split).ids) for split in cache.SPLITS)
    with pytest.raises(SpmlError) as refused:
        finetune.finetune(init="best", from_run=world.linear, loss="role", skip_missing=True,
                          **common(world, root=tmp_path / "empty", out=tmp_path / "out"))
    assert f"the image root {tmp_path / 'empty'} holds none of the cache's {total} images (e.g." in str(refused.value)
    assert "--skip-missing" not in str(refused.value) and not (tmp_path / "out").exists()


def test_missing_images_are_counted_and_refused_unless_skipped(world, tmp_path, monkeypatch):
    root = tmp_path / "data"
    shutil.copytree(world.root, root)
    gone = [world.features.train.ids[0], world.features.test.ids[-1]]
    for image_id in gone:
        (root / image_id).unlink()
    out = tmp_path / "out"
    missing = rf"2 of 22 images are missing under .*\({gone[0]}, {gone[1]}\).*--skip-missing"
    with pytest.raises(SpmlError, match=missing):
        finetune.finetune(init="best", from_run=world.linear, loss="role", **common(world, root=root, out=out))
    assert not out.exists()
    monkeypatch.setattr(losses.get("role"), "start_epoch", stop)
    with pytest.raises(Stop):
        finetune.finetune(init="best", from_run=world.linear, loss="role", skip_missing=True,
                          **common(world, root=root, out=out))
    (run_dir,) = (out / "voc").iterdir()
    assert runs.read_json(run_dir / "config.json")["skipped_images"] == {"train": 1, "val": 0, "test": 1}


def test_cuda_out_of_memory_suggests_a_smaller_batch_and_leaves_nothing(world, tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(finetune.run, "_train_epoch", out_of_memory)
    out = tmp_path / "out"
    with pytest.raises(SpmlError, match="out of memory.*smaller --batch-size"):
        finetune.finetune(init="best", from_run=world.linear, loss="role", **common(world, out=out))
    assert list((out / "voc").iterdir()) == []


def test_data_parallel_shares_are_the_single_process_batches():
    rows = np.arange(3, 26)  # 23 usable rows of 30: batches of 8 drop the trailing 7
    single = data.EpochBatches(rows, 30, 8, seed=4, rank=0, world=1)
    shares = [data.EpochBatches(rows, 30, 8, seed=4, rank=r, world=2) for r in range(2)]
    for epoch in (1, 2):
        for batches in [single, *shares]:
            batches.set_epoch(epoch)
        whole = list(single)
        assert len(whole) == 2 and all(len(batch) == 8 for batch in whole)
        assert [a + b for a, b in zip(*shares)] == whole
        assert set(sum(whole, [])) <= set(rows.tolist())
        assert torch.equal(shares[1].flips, single.flips)
    with pytest.raises(SpmlError, match="--batch-size 8 does not split over 3 processes"):
        parallel.check_batch_split([6, 8], parallel.Processes(torch.device("cpu"), Ranks(0, 3, 0)))


def _distributed_gradients(rank: int, world: int, port: int, images: torch.Tensor, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    processes = parallel.Processes(torch.device("cpu"), Ranks(rank, world, rank, owns_group=False))
    model = parallel.synchronise_batchnorm(small_model(), processes)
    share = len(images) // world
    trainer = torch.nn.parallel.DistributedDataParallel(model)  # kept alive: its hooks average the gradients
    local = trainer(images[rank * share : (rank + 1) * share])
    batch_coupled_loss(parallel.global_batch(local, processes)).backward()
    if rank == 0:
        torch.save({name: p.grad for name, p in model.named_parameters()} | {"running_var": model[1].running_var}, out)
    torch.distributed.destroy_process_group()


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3))


def batch_coupled_loss(logits: torch.Tensor) -> torch.Tensor:
    """A mean over entries plus EPR's batch-level term, which couples the rows of the global batch."""
    p = torch.sigmoid(logits)
    return torch.nn.functional.softplus(-logits).mean() + (p.sum() / len(p) - 1.5) ** 2


def test_two_gloo_processes_compute_the_single_process_gradient(tmp_path):
    """Sharing the batch (global BatchNorm statistics, gathered logits, DDP averaging) changes no gradient."""
    images = torch.randn(6, 3, 7, 7, generator=torch.Generator().manual_seed(1))
    model = small_model()
    batch_coupled_loss(model(images)).backward()
    # Spawned, not forked: this process has run autograd, and with CUDA about a fork is unsafe.
    torch.multiprocessing.start_processes(_distributed_gradients, args=(2, free_port(), images, tmp_path / "grads.pt"),
                                          nprocs=2, start_method="spawn")
    got = torch.load(tmp_path / "grads.pt", weights_only=True)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["running_var"], model[1].running_var, rtol=1e-5, atol=1e-7)


def test_non_finite_scores_are_named_as_divergence_never_a_result(world, tmp_path, monkeypatch):
    real = finetune.run._score
    scored = []

    def nan_on_test_from_the_second_epoch(model, setup, split, *kept):
        logits = real(model, setup, split, *kept)
        scored.append(split)
        if split == "test" and scored.count("test") >= 3:  # epoch 0 (the start), 1, then 2
            logits[0, 0] = float("nan")
        return logits

    monkeypatch.setattr(finetune.run, "_score", nan_on_test_from_the_second_epoch)
    lines = []
    results = finetune.finetune(init="best", from_run=world.linear, loss="role", log=lines.append,
                                **common(world, out=tmp_path))
    (config,) = results["losses"]["role"]["configs"]
    assert config["diverged_epoch"] == 2 and config["best_epoch"] == 1
    assert any("scores are not finite" in line and "diverged, stopped" in line for line in lines)
    text = (Path(results["run_dir"]) / "results.json").read_text()
    assert "NaN" not in text and results["losses"]["role"]["test_map"] == config["test_map"]


def test_authors_fidelity_is_recorded_and_takes_coles_code_linear_init_epochs(world, tmp_path):
    results = finetune.finetune(init="best", from_run=world.linear, loss="role", fidelity="authors",
                                **common(world, out=tmp_path, epochs=1))
    config = runs.read_json(Path(results["run_dir"]) / "config.json")
    assert results["fidelity"] == config["fidelity"] == "authors"  # kept once, with the other options
    # Cole et al.'s train.py fine-tunes its "+LinearInit" rows 10 epochs (the paper's Sec. 6.1 says 5): authors
    # mode follows the code, as exact mode follows the protocol's 10
    for fidelity in ("authors", "exact"):
        options = FinetuneOptions(from_run=world.linear, loss="role", weights=str(world.weights), fidelity=fidelity)
        setup = resolve(options, None, root=world.root, out=tmp_path, cache_dir=None, workers=0,
                        processes=parallel.Processes(torch.device("cpu")))
        assert setup.settings.options.epochs == 10 and setup.settings.options.fidelity == fidelity
    with pytest.raises(SpmlError, match="--fidelity 'nearly'"):
        finetune.finetune(init="best", from_run=world.linear, loss="role", fidelity="nearly", **common(world))


def test_a_text_side_loss_is_refused_in_one_line_with_or_without_a_clip_cache(world, tmp_path):
    """A text-side loss needs a CLIP cache, and a CLIP image tower is not fine-tuned end to end: both one line."""
    from linear_support import add_text_side

    with pytest.raises(SpmlError, match=r"voc.h5 has no text side .*--loss vlpl needs.*--backbone clip:ViT-B-16/openai"):
        finetune.finetune(init="imagenet", loss="vlpl", cache=world.cache, **common(world, out=tmp_path))
    clip = tmp_path / "voc-clip.h5"
    clip.write_bytes(Path(world.cache).read_bytes())
    add_text_side(clip)
    with pytest.raises(SpmlError, match=r"clip:ViT-B-16/openai is a CLIP image tower, which spml-cache does not"
                                        r" fine-tune end to end"):
        finetune.finetune(init="imagenet", loss="vlpl", cache=clip, **common(world, out=tmp_path, epochs=1))


def test_a_start_on_a_cache_without_checksum_notes_that_it_cannot_verify(world, tmp_path):
    """A cache written before checksums existed (no content_hash attr) cannot be verified: said in a note (issue
    36, item 6), where a sealed cache is verified in silence."""
    import h5py

    unsealed = tmp_path / "voc.h5"
    shutil.copy(world.cache, unsealed)
    with h5py.File(unsealed, "r+") as file:
        del file.attrs["content_hash"]
    classes = len(world.features.classes)
    head = {"weight": torch.zeros(classes, 2048), "bias": torch.zeros(classes)}
    older = write_linear_run(tmp_path / "runs" / "voc" / "linear-role-20240101-000000", unsealed, {"role": head})
    processes = parallel.Processes(torch.device("cpu"))
    for run, noted in ((older, True), (world.linear, False)):
        options = FinetuneOptions(from_run=run, loss="role", weights=str(world.weights))
        setup = resolve(options, None, root=world.root, out=tmp_path, cache_dir=None, workers=0, processes=processes)
        cache_path = unsealed if noted else world.cache
        expected = [f"note: cannot verify {cache_path}: it has no content checksum (written before checksums existed),"
                    " so a changed or swapped cache would go unnoticed; extract it again to give it one"]
        assert [note for note in setup.notes if "cannot verify" in note] == (expected if noted else [])


def test_a_random_trunk_says_batchnorm_training_moves_its_features(world, tmp_path):
    def setup(weights):
        options = FinetuneOptions(from_run=world.linear, loss="role", weights=weights)
        return resolve(options, None, root=world.root, out=tmp_path, cache_dir=None, workers=0,
                       processes=parallel.Processes(torch.device("cpu")))

    random_trunk = setup("none")  # said as the settings are resolved; the trunk is built where the run starts
    assert any("--weights none" in note and "BatchNorm statistics" in note for note in random_trunk.notes)
    assert random_trunk.initial is None
    with pytest.warns(RandomWeightsWarning):
        initial_model(random_trunk)
    assert not any("BatchNorm" in note for note in setup(str(world.weights)).notes)


def test_the_summary_line_marks_a_result_that_ended_below_its_start():
    from spml_cache.cli.text import finetune_summary

    entry = {"selected": {"lr": 1e-5, "batch_size": 8}, "val_map": 9.5, "val_map_std": 0.0, "test_map": 10.07,
             "test_map_std": 0.0, "best_epoch": [1], "start": {"val_map": 40.0, "test_map": 38.40}}
    for below in (True, False):
        console = Console(file=io.StringIO(), width=300)
        for line in finetune_summary({"run_dir": "runs/x[/]y", "losses": {"an_ls": {**entry, "below_start": below}}}):
            console.print(line)
        text = console.file.getvalue()
        assert ("below its start (epoch 0: test mAP 38.40) -> runs/x[/]y" in text) == below
        assert text.startswith("an_ls lr 1e-05, batch 8: val mAP 9.50") and "-> runs/x[/]y" in text
