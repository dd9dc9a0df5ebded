"""`extract --labels auto|dense|sparse`: label matrices that stay sparse from the OpenImages reader to the cache
(plan_rows, the shards, the writer), a dense cache of sparse-read labels, a sparse cache of a dense dataset."""

import sys
from types import SimpleNamespace

import numpy as np
import pytest
from cli_support import run_cli
from extract_support import write_jpeg
from linear_support import quiet
from test_extract_sharded import torchrun

from spml_cache import cache, observation
from spml_cache.demo.data import make_demo_data
from spml_cache.extract import extract
from spml_cache.extract.plan import estimated_size, plan_rows
from spml_cache.extract.shards import Shard
from spml_cache.labels import SparseLabels, dense as densified, is_sparse, same
from spml_cache.linear import run_linear
from spml_cache.observation import parse_rules
from spml_cache.runtime.errors import SpmlError

pytestmark = pytest.mark.filterwarnings("ignore::spml_cache.backbones.checkpoints.RandomWeightsWarning")

VERIFIED_CLASSES = 12  # images are verified on these; the rest of the >= 1,000 trainable classes never are


def write_openimages(root, num_classes=1010, num_train=14, num_test=6):
    """A tiny OpenImages V6 layout with `num_classes` trainable classes; each image has a few verified labels."""
    rng = np.random.default_rng(3)
    names = [f"/m/c{k:04d}" for k in range(num_classes)]
    root.mkdir(parents=True, exist_ok=True)
    (root / "oidv6-class-descriptions.csv").write_text("".join(f"{n},Class {n[4:]}\n" for n in names))
    (root / "oidv6-classes-trainable.txt").write_text("\n".join(names) + "\n")
    for split, count in (("train", num_train), ("test", num_test)):
        lines = ["ImageID,Source,LabelName,Confidence"]
        for k in range(count):
            image = f"{split}{k:012x}"
            write_jpeg(root / split / f"{image}.jpg", seed=k + 100 * (split == "test"))
            chosen = rng.choice(VERIFIED_CLASSES, size=4, replace=False)
            lines += [f"{image},verification,{names[c]},{int(i < 2)}" for i, c in enumerate(chosen)]
        (root / f"oidv6-{split}-annotations-human-imagelabels.csv").write_text("\n".join(lines) + "\n")
    return root


def random_matrix(rng, rows, classes, values=(1,), density=0.2):
    dense = np.where(rng.random((rows, classes)) < density, rng.choice(values, size=(rows, classes)), 0)
    return dense.astype(np.int8)


def protocol_like(rng, rows=(9, 5, 7), classes=30, density=0.2):
    """A protocol result holding SparseLabels (labels, observed, mask), as apply_protocol gives for OpenImages."""
    splits = {}
    for name, count in zip(cache.SPLITS, rows):
        labels, mask = (random_matrix(rng, count, classes, density=density) for _ in range(2))
        observed = None if name == "test" else random_matrix(rng, count, classes, (1, -1), density)
        splits[name] = SimpleNamespace(ids=[f"{name}/{i}.jpg" for i in range(count)],
                                       labels=SparseLabels.from_dense(labels),
                                       observed=None if observed is None else SparseLabels.from_dense(observed),
                                       mask=SparseLabels.from_dense(mask),
                                       dense=(labels, observed, mask))
    return SimpleNamespace(**splits)


def test_planned_and_sharded_rows_stay_sparse_and_equal_the_dense_cut():
    planned = protocol_like(np.random.default_rng(0))
    for limit in (0, 4):
        rows = plan_rows(planned, limit)
        for name in cache.SPLITS:
            count = len(getattr(planned, name).ids) if limit == 0 else limit
            assert len(rows[name]) == count
            for matrix, dense in zip((rows[name].labels, rows[name].observed, rows[name].label_mask),
                                     getattr(planned, name).dense):
                assert (matrix is None) == (dense is None)
                if matrix is not None:
                    assert is_sparse(matrix) and np.array_equal(matrix.to_dense(), dense[:count])
    rows = plan_rows(planned, 0)
    for rank in range(2):
        mine = Shard(SimpleNamespace(rank=rank, world=2)).rows(rows)
        for name in cache.SPLITS:
            labels, observed, mask = getattr(planned, name).dense
            assert mine[name].ids == rows[name].ids[rank::2]
            assert is_sparse(mine[name].labels) and is_sparse(mine[name].label_mask)
            assert np.array_equal(mine[name].labels.to_dense(), labels[rank::2])
            assert np.array_equal(mine[name].label_mask.to_dense(), mask[rank::2])
            if observed is not None:
                assert np.array_equal(mine[name].observed.to_dense(), observed[rank::2])


def test_the_estimated_size_counts_sparse_labels_by_their_entries():
    rows = plan_rows(protocol_like(np.random.default_rng(1), classes=5000, density=0.002), 0)
    dense = {name: cache.SplitRows(r.ids, r.labels.to_dense(), None if r.observed is None else r.observed.to_dense(),
                                   r.label_mask.to_dense()) for name, r in rows.items()}
    as_csr, as_dense = estimated_size(rows, 5000, 16, "sparse"), estimated_size(rows, 5000, 16, "dense")
    assert estimated_size(dense, 5000, 16, "sparse") == as_csr  # entries counted the same, dense or sparse given
    assert estimated_size(dense, 5000, 16, "dense") == as_dense
    matrices = [(len(r), m.nnz) for r in rows.values() for m in (r.labels, r.observed, r.label_mask) if m is not None]
    # each matrix: a byte an entry dense; 8 bytes a row (indptr) and 5 a non-zero entry (index, value) as CSR
    assert as_dense - as_csr == sum(n * 5000 - 8 * (n + 1) - 5 * nnz for n, nnz in matrices) > 0


def test_a_bad_labels_choice_is_one_line(tmp_path):
    with pytest.raises(SpmlError, match=r"--labels 'csr': use auto .*, dense or sparse"):
        extract("voc", tmp_path, labels="csr")
    done = run_cli("extract", "voc", "--root", str(tmp_path), "--labels", "csr", cwd=tmp_path)  # the flag travels
    assert done.returncode != 0 and "--labels 'csr': use auto (sparse from 1000 classes)" in done.stderr, done.stderr


@pytest.fixture(scope="module")
def voc(tmp_path_factory):
    folder = tmp_path_factory.mktemp("voc")
    root = make_demo_data(folder / "data", num_train=16, num_test=6, size=32)
    common = dict(backbone="resnet18", weights="none", resolution=32, batch_size=8, workers=0, device="cpu")
    paths = {form: extract("voc", root, out=folder / form / "voc.h5", labels=form, **common).path
             for form in ("dense", "sparse")}
    return root, common, paths


def test_a_sparse_cache_of_a_dense_dataset_trains_like_the_dense_one(tmp_path, voc):
    _, _, paths = voc
    dense, stored = cache.load(paths["dense"]), cache.load(paths["sparse"])
    assert not is_sparse(dense.train.labels) and is_sparse(stored.train.labels)
    for name in cache.SPLITS:
        mine, theirs = getattr(stored, name), getattr(dense, name)
        assert mine.ids == theirs.ids and same(mine.labels, theirs.labels)
        assert (mine.observed is None) == (theirs.observed is None)
        assert mine.observed is None or same(mine.observed, theirs.observed)
        np.testing.assert_array_equal(mine.features, theirs.features)
    results = [run_linear(cache=paths[form], losses=["an"], lrs=[1e-2], batch_sizes=[8], epochs=2,
                          out=tmp_path / form, workers=0, device="cpu", console=quiet()).results["losses"]["an"]
               for form in ("dense", "sparse")]
    for key in ("val_map", "test_map", "per_class_ap", "best_epoch"):
        assert results[0][key] == results[1][key], key


def test_a_cache_in_the_other_label_format_is_not_up_to_date(voc):
    root, common, paths = voc
    with pytest.raises(SpmlError, match=r"was built with other settings \(--labels: dense in the file, sparse now\)"
                                        r": pass --force"):
        extract("voc", root, out=paths["dense"], labels="sparse", **common)
    assert extract("voc", root, out=paths["sparse"], labels="sparse", **common).status == "up to date"


@pytest.fixture(scope="module")
def openimages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openimages")
    root = write_openimages(folder / "data")
    # a small seeded random trunk: every process builds the same one
    common = dict(backbone="resnet18", weights="none", resolution=32, batch_size=8, workers=0, device="cpu")
    return folder, root, common


def same_rows(first, second) -> None:
    """Two caches hold the same rows: ids, labels, observed labels and label masks by value (dense or sparse)."""
    for name in cache.SPLITS:
        mine, theirs = getattr(first, name), getattr(second, name)
        assert mine.ids == theirs.ids, name
        for key in ("labels", "observed", "label_mask"):
            a, b = getattr(mine, key), getattr(theirs, key)
            assert (a is None) == (b is None), (name, key)
            assert a is None or np.array_equal(densified(a), densified(b)), (name, key)


def test_openimages_extracts_sparse_by_default_and_dense_on_request(openimages):
    folder, root, common = openimages
    made = {form: cache.load(extract("openimages", root, out=folder / form / "oi.h5", labels=form, limit=5,
                                     **common).path) for form in ("auto", "dense")}
    stored, dense = made["auto"], made["dense"]
    assert all(is_sparse(m) for m in (stored.train.labels, stored.train.observed, stored.test.label_mask))
    assert not any(is_sparse(m) for m in (dense.train.labels, dense.train.observed, dense.test.label_mask))
    assert len(stored.train) == len(stored.test) == 5 and stored.train.labels.shape[1] == 1010
    same_rows(stored, dense)
    # the single positive is one of the verified positives; nothing unverified is observed
    observed, mask = densified(stored.train.observed), densified(stored.train.label_mask)
    assert (observed[mask == 0] == 0).all() and ((observed == 1).sum(axis=1) <= 1).all()
    assert (densified(stored.train.labels)[observed == 1] == 1).all()


def test_observe_given_is_stored_beside_single_from_the_sparse_mask(openimages):
    """Rules stored at extraction stay sparse beside sparse labels, and equal the dense draw."""
    folder, root, common = openimages
    stored = cache.load(extract("openimages", root, out=folder / "one" / "oi.h5",
                                observe=parse_rules("given,entry:0.5"), **common).path)
    assert is_sparse(stored.train.observed)  # single's
    for split in (stored.train, stored.val):
        assert is_sparse(split.rules["given"]) and is_sparse(split.rules["entry:0.5"])
        given = densified(split.rules["given"])
        labels, mask = densified(split.labels), densified(split.label_mask)
        np.testing.assert_array_equal(given, np.where(mask == 1, 2 * labels - 1, 0))  # every verified label, signed
    dense_draw = observation.draw_splits(
        parse_rules("entry:0.5")[0], densified(stored.train.labels, np.uint8), densified(stored.val.labels, np.uint8),
        stored.attrs, label_masks=(densified(stored.train.label_mask), densified(stored.val.label_mask)))
    for split, drawn in zip((stored.train, stored.val), dense_draw):
        np.testing.assert_array_equal(densified(split.rules["entry:0.5"]), drawn)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's CPU processes, as CI has")
def test_two_ranks_on_the_sparse_layout_equal_one_process(openimages):
    """Against the one-process cache of the test above (run it first: same flags)."""
    folder, root, common = openimages
    flags = ["--root", str(root), "--backbone", "resnet18", "--weights", "none", "--resolution", "32",
             "--batch-size", "8", "--workers", "0", "--device", "cpu", "--observe", "given,entry:0.5"]
    out = folder / "two" / "oi.h5"
    stdout, stderr = torchrun("extract", "openimages", *flags, "--out", str(out), cwd=folder).communicate(timeout=300)
    assert out.exists(), stderr
    one = folder / "one" / "oi.h5"
    if not one.exists():
        test_observe_given_is_stored_beside_single_from_the_sparse_mask(openimages)
    joined, alone = cache.load(out), cache.load(one)
    assert is_sparse(joined.train.labels) and is_sparse(joined.test.label_mask)
    same_rows(joined, alone)
    for name in cache.SPLITS:
        mine, theirs = getattr(joined, name), getattr(alone, name)
        assert mine.rules.keys() == theirs.rules.keys()
        for rule in mine.rules:
            assert same(mine.rules[rule], theirs.rules[rule])
        np.testing.assert_allclose(mine.features, theirs.features, rtol=1e-4, atol=1e-4)
