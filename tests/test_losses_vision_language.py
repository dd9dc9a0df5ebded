"""vlpl and gpr against docs/losses.md ("Vision-language pseudo-labels"): VLPL's EM_PL (Xing et al.) and AEVLP's
GPR loss (Tran et al.), restated here entry by entry in plain math; and the cache's text side they read."""

import math

import h5py
import numpy as np
import pytest
import torch
from loss_support import entropy, nl, sigmoid

from spml_cache import cache, losses
from spml_cache.runtime.errors import SpmlError

LOGITS = np.array([[2.0, -1.0, 0.5, -3.0, 1.2], [-0.3, 1.5, -2.0, 3.0, 0.0], [0.7, 0.2, -0.4, 1.1, -1.6]])
OBSERVED = np.array([[1, 0, 0, 0, 0], [0, 1, -1, 0, 0], [0, 0, 0, 1, 0]])
# cosine similarities of 3 images with 5 class prompts: the softmax at T = 0.01 is sharp
SIMILARITY = np.array([[0.31, 0.30, 0.22, 0.18, 0.305], [0.20, 0.27, 0.275, 0.21, 0.19], [0.25, 0.24, 0.26, 0.30, 0.10]])
INDEX = torch.arange(3)


def softmax_row(row, temperature):
    top = max(row)
    exps = [math.exp((value - top) / temperature) for value in row]
    return [value / sum(exps) for value in exps]


def build(name, **kwargs):
    kwargs.setdefault("dataset", "voc")
    kwargs.setdefault("train_similarity", torch.tensor(SIMILARITY))
    return losses.build(name, num_classes=5, train_observed=torch.tensor(OBSERVED), **kwargs)


# --- vlpl ------------------------------------------------------------------------------------------------------


def vlpl_value(alpha, beta=0.7, rho=0.9, temperature=0.01, threshold=0.3):
    total = 0.0
    for n in range(3):
        scores = softmax_row(SIMILARITY[n], temperature)
        for c in range(5):
            p = sigmoid(LOGITS[n, c])
            if OBSERVED[n, c] == 1:
                total += nl(p)
            elif OBSERVED[n, c] == -1:
                total += nl(1 - p)  # a known negative, never a pseudo-positive
            elif scores[c] > threshold:
                total += beta * (rho * nl(p) + (1 - rho) * nl(1 - p))
            else:
                total += -alpha * entropy(p)
    return total / LOGITS.size


@pytest.mark.parametrize("dataset, alpha", [("voc", 0.2), ("coco", 0.1), ("nus", 0.1), ("cub", 0.01)])
def test_vlpl_matches_the_equation_with_each_datasets_alpha(dataset, alpha):
    loss = build("vlpl", dataset=dataset)
    assert loss.hparams == {"alpha": alpha, "beta": 0.7, "rho": 0.9, "temperature": 0.01, "threshold": 0.3}
    value = loss(torch.tensor(LOGITS), torch.tensor(OBSERVED), index=INDEX)
    assert value.item() == pytest.approx(vlpl_value(alpha), rel=1e-10)


def test_vlpl_pseudo_positives_are_the_softmax_above_the_threshold_on_unobserved_entries():
    loss = build("vlpl")
    expected = [[softmax_row(SIMILARITY[n], 0.01)[c] > 0.3 and OBSERVED[n, c] == 0 for c in range(5)] for n in range(3)]
    assert loss.pseudo_positive[0].tolist() == expected
    assert any(map(any, expected)) and not all(map(all, expected))  # the example has both kinds
    # image 1: class 2 scores highest but is an observed negative, so it is no pseudo-positive
    assert softmax_row(SIMILARITY[1], 0.01)[2] > 0.3 and not loss.pseudo_positive[0, 1, 2]


def test_vlpl_threshold_and_temperature_are_hyperparameters():
    loose = build("vlpl", temperature=1.0, threshold=0.0)  # every unobserved entry is a pseudo-positive
    assert loose.pseudo_positive[0].tolist() == (torch.tensor(OBSERVED) == 0).tolist()
    value = loose(torch.tensor(LOGITS), torch.tensor(OBSERVED), index=INDEX).item()
    assert value == pytest.approx(vlpl_value(0.2, temperature=1.0, threshold=0.0), rel=1e-10)


def test_vlpl_authors_numerics_add_eps_inside_the_logs():
    loss = build("vlpl", fidelity="authors")
    x = torch.tensor([[30.0, -30.0, 0.0, 0.0, 0.0]] * 3)
    value = loss(x, torch.tensor(OBSERVED), index=INDEX).item()
    assert math.isfinite(value) and loss.log_eps == 1e-5


# --- gpr -------------------------------------------------------------------------------------------------------

CROPS = np.array([  # 3 images x 4 crops (a 2 x 2 grid) x 5 classes
    [[0.30, 0.20, 0.29, 0.10, 0.12], [0.10, 0.22, 0.21, 0.30, 0.11], [0.2, 0.2, 0.2, 0.2, 0.2], [0.15, 0.3, 0.1, 0.1, 0.1]],
    [[0.20, 0.25, 0.10, 0.10, 0.31], [0.22, 0.21, 0.20, 0.19, 0.18], [0.1, 0.1, 0.3, 0.1, 0.1], [0.12, 0.3, 0.29, 0.1, 0.1]],
    [[0.25, 0.24, 0.10, 0.30, 0.10], [0.30, 0.10, 0.10, 0.10, 0.10], [0.1, 0.3, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.3, 0.1]],
])


def aevlp_labels(temperature, eta, threshold, top_k, negatives, crops=None, negative_label=-1):
    """AEVLP's pseudo-labelling restated per image: 1, -1 or 0 for each class (the negatives, written after the
    positives, as `negative_label`: -1 in the paper, 0 in the authors' code)."""
    out = []
    for n in range(3):
        g = softmax_row(SIMILARITY[n], temperature)
        if crops is None:
            final = negative = g
        else:
            local = [softmax_row(crop, temperature) for crop in crops[n]]
            observed_score = max(g[c] for c in range(5) if OBSERVED[n, c] == 1)
            eta_n = min(observed_score, eta)
            final, negative = [], []
            for c in range(5):
                column = [crop[c] for crop in local]
                kept = max(column) if max(column) > eta_n else min(column)
                final.append((g[c] + kept) / 2)
                negative.append((g[c] + sum(column) / len(column)) / 2)
        labels = [0] * 5
        for c in sorted(range(5), key=lambda c: -final[c])[:top_k]:
            labels[c] = 1 if final[c] >= threshold else 0
        for c in sorted(range(5), key=lambda c: negative[c])[:negatives]:
            labels[c] = negative_label
        out.append([0 if OBSERVED[n, c] != 0 else labels[c] for c in range(5)])
    return out


def gpr_value(pseudo, *, epoch, num_epochs, wT, bT, lambda1, lambda2, reg, k, q2=0.01, q3=1.0, rho=0.9):
    w = wT * max(epoch - 1, 0) / num_epochs  # GR's schedules (w0 = 0, b0 = -2, mu 0.5 -> 0.8, sigma 2 -> 0.5)
    b = -2 + (bT + 2) * max(epoch - 1, 0) / num_epochs
    mu, sigma = 0.5 + 0.3 * epoch / num_epochs, 2.0 - 1.5 * epoch / num_epochs
    total, positives = 0.0, 0.0
    for n in range(3):
        for c in range(5):
            p = sigmoid(LOGITS[n, c])
            positives += p
            v = math.exp(-((p - mu) ** 2) / (2 * sigma**2))
            if OBSERVED[n, c] == 1:
                total += nl(p)
            elif OBSERVED[n, c] == -1:
                total += nl(1 - p)
            elif pseudo[n][c] == 1:
                total += (1 - min(max(v, 1 - lambda1), 1 - lambda2)) * (rho * nl(p) + (1 - rho) * nl(1 - p))
            elif pseudo[n][c] == -1:
                total += v * nl(1 - p)
            else:
                kk = sigmoid(w * p + b)
                total += v * (kk * (1 - p**q2) / q2 + (1 - kk) * (1 - (1 - p) ** q3) / q3)
    return total / LOGITS.size + reg * ((positives / 3 - k) / 5) ** 2


@pytest.mark.parametrize("dataset, epoch, threshold", [("voc", 1, None), ("voc", 6, 0.3), ("coco", 4, 0.2)])
def test_gpr_global_only_matches_the_equation(dataset, epoch, threshold):
    loss = build("gpr", dataset=dataset, **({"threshold": threshold} if threshold else {}))
    hp = loss.hparams
    pseudo = aevlp_labels(hp["temperature"], hp["eta"], hp["threshold"], hp["top_k"], int(hp["negative_ratio"] * 5))
    assert loss.pseudo_label[0].tolist() == pseudo
    assert threshold is None or {1, -1} <= {label for row in pseudo for label in row}  # both kinds
    loss.start_epoch(epoch, 8)
    expected = gpr_value(pseudo, epoch=epoch, num_epochs=8, wT=hp["wT"], bT=hp["bT"], lambda1=hp["lambda1"],
                         lambda2=hp["lambda2"], reg=hp["reg"], k=hp["k"])
    assert loss(torch.tensor(LOGITS), torch.tensor(OBSERVED), index=INDEX).item() == pytest.approx(expected, rel=1e-9)


def test_gpr_crop_grid_pseudo_labels_and_value():
    options = dict(temperature=0.05, eta=0.3, threshold=0.2, top_k=2, negative_ratio=0.2)
    loss = build("gpr", dataset="coco", train_crop_similarity=torch.tensor(CROPS), **options)
    pseudo = aevlp_labels(0.05, 0.3, 0.2, 2, 1, crops=CROPS)
    assert loss.pseudo_label[0].tolist() == pseudo
    assert pseudo != aevlp_labels(0.05, 0.3, 0.2, 2, 1)  # the crops change something here
    loss.start_epoch(3, 8)
    expected = gpr_value(pseudo, epoch=3, num_epochs=8, wT=10, bT=-8, lambda1=0.7, lambda2=0.5, reg=0.001, k=2.9)
    assert loss(torch.tensor(LOGITS), torch.tensor(OBSERVED), index=INDEX).item() == pytest.approx(expected, rel=1e-9)


def test_gpr_per_dataset_defaults_are_the_authors_configs():
    table = {  # lambda1, lambda2, reg, eta, threshold, temperature, negative_ratio, top_k, k, wT, bT, q3
        "voc": (0.7, 0.4, 0.05, 0.0, 0.5, 0.01, 0.2, 3, 1.5, 2, -2, 1.0),
        "coco": (0.7, 0.5, 0.001, 0.3, 0.5, 0.01, 0.3, 3, 2.9, 10, -8, 1.0),
        "nus": (0.7, 0.5, 0.001, 0.3, 0.6, 0.01, 0.2, 3, 1.9, 10, -8, 1.0),
        "cub": (0.8, 0.2, 0.01, 0.005, 0.005, 0.1, 0.2, 32, 31.4, 10, -8, 1.5),
    }
    keys = ("lambda1", "lambda2", "reg", "eta", "threshold", "temperature", "negative_ratio", "top_k", "k", "wT", "bT",
            "q3")
    observed = torch.zeros(3, 40, dtype=torch.int8)
    observed[:, 0] = 1
    for dataset, values in table.items():
        hp = losses.build("gpr", num_classes=40, dataset=dataset, train_observed=observed,
                          train_similarity=torch.rand(3, 40)).hparams
        assert tuple(hp[key] for key in keys) == values, dataset
        assert (hp["rho"], hp["w0"], hp["b0"], hp["mu0"], hp["sigma0"], hp["muT"], hp["sigmaT"]) == (
            0.9, 0.0, -2.0, 0.5, 2.0, 0.8, 0.5)


def test_gpr_authors_fidelity_writes_negatives_as_zero():
    paper, authors = build("gpr"), build("gpr", fidelity="authors")
    assert (paper.pseudo_label == -1).any()
    assert not (authors.pseudo_label == -1).any()
    assert torch.equal(authors.pseudo_label == 1, paper.pseudo_label == 1)


def test_gpr_authors_fidelity_clears_a_pseudo_positive_among_the_negatives():
    # every class reaches the threshold, so the two lowest negative scores fall on pseudo-positives
    options = dict(temperature=0.05, eta=0.3, threshold=0.0, top_k=5, negative_ratio=0.4)
    loss = build("gpr", dataset="coco", train_crop_similarity=torch.tensor(CROPS), fidelity="authors", **options)
    expected = aevlp_labels(0.05, 0.3, 0.0, 5, 2, crops=CROPS, negative_label=0)
    assert loss.pseudo_label[0].tolist() == expected
    positives = aevlp_labels(0.05, 0.3, 0.0, 5, 0, crops=CROPS)  # the positives alone, before the negatives
    cleared = [(n, c) for n in range(3) for c in range(5) if positives[n][c] == 1 and expected[n][c] == 0]
    assert cleared  # the case in question occurs: a pseudo-positive the negatives' 0 took away


def test_gpr_refuses_lambda2_above_lambda1():
    with pytest.raises(SpmlError, match="lambda2=0.8 exceeds lambda1=0.3"):
        build("gpr", lambda1=0.3, lambda2=0.8)


# --- refusals and the cache's text side --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["vlpl", "gpr"])
def test_a_text_side_loss_without_similarities_is_one_line(name):
    with pytest.raises(SpmlError) as err:
        losses.build(name, num_classes=5, dataset="voc", train_observed=torch.tensor(OBSERVED))
    assert "text side" in str(err.value) and "--backbone clip:ViT-B-16/openai" in str(err.value)
    with pytest.raises(SpmlError, match=r"expected \[3, 5\]"):
        build(name, train_similarity=torch.rand(4, 5))


def test_names_leave_out_the_text_side_losses_for_a_cache_without_one():
    assert {"vlpl", "gpr"} <= set(losses.names())
    assert not {"vlpl", "gpr"} & set(losses.names(similarity=False))
    assert "crisp" in losses.names(similarity=False)


def test_the_cache_reads_its_text_side(tmp_path):
    from linear_support import add_text_side, write_synthetic_cache

    plain = write_synthetic_cache(tmp_path / "plain.h5", train=12, val=6, test=6, classes=4, dim=8)
    features = cache.load(plain)
    assert not features.has_text_side and features.text_embeddings is None and features.train.image_embeddings is None
    with pytest.raises(SpmlError, match=r"plain.h5 has no text side .* --backbone clip:ViT-B-16/openai"):
        features.require_text_side(["vlpl"])
    clip = add_text_side(write_synthetic_cache(tmp_path / "clip.h5", train=12, val=6, test=6, classes=4, dim=8), grid=2)
    features = cache.load(clip)
    assert features.has_text_side and features.text_embeddings.shape == (4, 6)
    np.testing.assert_allclose(features.similarity("test"), features.test.image_embeddings @ features.text_embeddings.T,
                               rtol=1e-6)
    assert features.crop_similarity("train").shape == (12, 4, 4)
    with h5py.File(clip, "r+") as file:
        file["val"]["image_embeddings"][0] *= 2  # no longer L2-normalised
    with pytest.raises(SpmlError, match=r"/val/image_embeddings holds rows that are not L2-normalised"):
        cache.load(clip)


# --- stage two and the report on a cache with (and without) a text side ----------------------------------------


def test_linear_trains_the_text_side_losses_and_reports_the_zero_shot_row(tmp_path):
    from linear_support import add_text_side, quiet, write_synthetic_cache

    from spml_cache.linear import run_linear
    from spml_cache.metrics import mean_average_precision
    from spml_cache.report.collect import collect_runs
    from spml_cache.report.tables import build_table, to_markdown

    clip = add_text_side(write_synthetic_cache(tmp_path / "voc-clip-224.h5", train=40, val=16, test=20, classes=4,
                                               dim=8), grid=2)
    run = run_linear(cache=clip, losses=["vlpl", "gpr", "crisp"], lrs=[1e-2], batch_sizes=[8], epochs=2,
                     out=tmp_path / "runs", device="cpu", console=quiet())
    results = run.results
    assert list(results["losses"]) == ["vlpl", "gpr", "crisp"]
    assert all(entry["test_map"] is not None for entry in results["losses"].values())
    zero_shot = results["reference"]["zero_shot"]
    expected = cache.load(clip)
    assert zero_shot["test_map"] == pytest.approx(mean_average_precision(expected.similarity("test"), expected.test.labels))
    assert zero_shot["backbone"] == "clip:ViT-B-16/openai" and 0 <= zero_shot["val_map"] <= 100
    table = to_markdown(build_table(collect_runs([tmp_path / "runs"])))
    (row,) = [line for line in table.splitlines() if line.startswith("| zero-shot (reference)")]
    assert f"{zero_shot['test_map']:.2f}" in row and "**" not in row  # never marked as the best loss


def test_linear_refuses_a_text_side_loss_on_a_cache_without_one(tmp_path, monkeypatch, capsys):
    from cli_support import run_main
    from linear_support import write_synthetic_cache

    plain = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=20, val=8, test=8, classes=4, dim=8)
    code, stderr = run_main("linear", "--cache", str(plain), "--loss", "an,gpr", "--lr", "1e-2", "--batch-size", "8",
                            "--epochs", "1", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1
    (line,) = stderr.strip().splitlines()
    assert str(plain) in line and "--loss gpr needs" in line and "--backbone clip:ViT-B-16/openai" in line
    assert not (tmp_path / "runs").exists()  # refused before anything was written
