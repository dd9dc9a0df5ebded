"""Embeddings in and out in the clip-retrieval layout: `import-features DIR --dataset D --root R` matches each
image to its row by path or id (counts said, missing or repeated rows refused), `spml-cache export CACHE --out
DIR` writes a cache's splits there, and export then import gives the same features for every row."""

from __future__ import annotations

import os
import site
from pathlib import Path

import numpy as np
import pytest
from cli_support import REPO, run_cli, run_main
from extract_support import write_numbered_csv_dataset

from spml_cache import cache
from spml_cache.runtime.errors import SpmlError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

COUNT, FIRST_TEST, WIDTH = 14, 10, 6
CLASSES = ("a", "b", "c")


def environment(tmp_path) -> dict:
    """The subprocess's PYTHONPATH: this checkout, and pyarrow's folder where it is not the interpreter's own."""
    where = str(Path(pa.__file__).parents[1])
    extra = [] if where in site.getsitepackages() else [where]
    return {"PYTHONPATH": os.pathsep.join([str(REPO), *extra]), "SPML_CACHE": str(tmp_path / "cache")}


def write_layout(folder: Path, parts: list[tuple[np.ndarray, dict]]) -> None:
    (folder / "img_emb").mkdir(parents=True)
    (folder / "metadata").mkdir()
    for index, (array, columns) in enumerate(parts):
        np.save(folder / "img_emb" / f"img_emb_{index}.npy", array)
        pq.write_table(pa.table(columns), folder / "metadata" / f"metadata_{index}.parquet")


@pytest.fixture
def data(tmp_path):
    """A CSV dataset of 14 images and clip-retrieval's output for it: two parts, rows in another order, absolute
    image paths, float16, and two rows for images that are not the dataset's. Returns (root, layout, id -> row)."""
    root = write_numbered_csv_dataset(tmp_path / "data", COUNT, first_test=FIRST_TEST, classes=CLASSES)
    rng = np.random.default_rng(0)
    names = [f"images/{k}.jpg" for k in rng.permutation(COUNT)] + ["images/other-1.jpg", "images/other-2.jpg"]
    rows = rng.standard_normal((len(names), WIDTH)).astype(np.float16)
    paths = [str(root.resolve() / name) for name in names]
    write_layout(tmp_path / "emb", [(rows[:9], {"image_path": paths[:9], "caption": ["x"] * 9}),
                                    (rows[9:], {"image_path": paths[9:], "caption": ["x"] * (len(names) - 9)})])
    expected = {name: rows[i].astype(np.float32) for i, name in enumerate(names)}
    return root, tmp_path / "emb", expected


def labels_of(image_id: str) -> np.ndarray:
    """The CSV's labels restated: image k has the first 1 + k % 3 classes."""
    k = int(image_id.split("/")[1].split(".")[0])
    return np.array([1 if c < 1 + k % len(CLASSES) else 0 for c in range(len(CLASSES))], dtype=np.uint8)


def test_import_matches_every_image_by_path_and_says_what_matched(data, tmp_path):
    root, layout, expected = data
    done = run_cli("import-features", str(layout), "--dataset", "csv", "--root", str(root), cwd=tmp_path,
                   env=environment(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"matched {COUNT} of {COUNT + 2} embedding rows to the images of csv by image_path" in done.stdout
    assert "2 rows name no image of it and were left out" in done.stdout
    features = cache.load(tmp_path / "cache" / "csv-imported-0.h5")
    assert sorted(features.train.ids + features.val.ids) == sorted(f"images/{k}.jpg" for k in range(FIRST_TEST))
    assert sorted(features.test.ids) == sorted(f"images/{k}.jpg" for k in range(FIRST_TEST, COUNT))
    for split in (features.train, features.val, features.test):
        np.testing.assert_array_equal(split.features, np.stack([expected[i] for i in split.ids]))
        np.testing.assert_array_equal(split.labels, np.stack([labels_of(i) for i in split.ids]))
    assert (features.attrs["backbone"], features.attrs["feature_dim"]) == ("imported", WIDTH)


def test_export_then_import_gives_the_same_features_for_every_row(data, tmp_path):
    root, layout, _ = data
    env = environment(tmp_path)
    assert run_cli("import-features", str(layout), "--dataset", "csv", "--root", str(root), cwd=tmp_path,
                   env=env).returncode == 0
    original = cache.load(tmp_path / "cache" / "csv-imported-0.h5")
    done = run_cli("export", str(tmp_path / "cache" / "csv-imported-0.h5"), "--out", str(tmp_path / "out"),
                   cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    for index, name in enumerate(cache.SPLITS):  # one part per split, labels and observed beside the ids
        split = getattr(original, name)
        table = pq.read_table(tmp_path / "out" / "metadata" / f"metadata_{index}.parquet").to_pydict()
        assert table["id"] == split.ids and table["image_path"] == split.ids and set(table["split"]) == {name}
        np.testing.assert_array_equal(np.array(table["labels"]), split.labels)
        if split.observed is None:
            assert table["observed"] == [None] * len(split)
        else:
            np.testing.assert_array_equal(np.array(table["observed"]), split.observed)
        np.testing.assert_array_equal(np.load(tmp_path / "out" / "img_emb" / f"img_emb_{index}.npy"), split.features)
    import shutil

    shutil.rmtree(root)  # the export alone: no --root, no --dataset, no images
    env.pop("SPML_DATA", None)
    again = run_cli("import-features", str(tmp_path / "out"), "--out", str(tmp_path / "again.h5"), cwd=tmp_path,
                    env=env)
    assert again.returncode == 0, again.stderr
    assert "no images were read" in again.stdout
    imported = cache.load(tmp_path / "again.h5")
    for name in cache.SPLITS:
        assert getattr(imported, name).ids == getattr(original, name).ids
        np.testing.assert_array_equal(getattr(imported, name).features, getattr(original, name).features)
        np.testing.assert_array_equal(getattr(imported, name).labels, getattr(original, name).labels)
        if name == "test":
            assert imported.test.observed is None
        else:
            np.testing.assert_array_equal(getattr(imported, name).observed, getattr(original, name).observed)
    kept = ("dataset", "classes", "backbone", "split_seed", "val_frac", "observe_seed", "num_pos", "num_neg",
            "expected_positives")
    assert {key: imported.attrs[key] for key in kept} == {key: original.attrs[key] for key in kept}


def test_an_older_export_without_its_protocol_settings_is_matched_to_the_images_under_root(data, tmp_path,
                                                                                          monkeypatch, capsys):
    import json

    from spml_cache.cache.embeddings import export
    from spml_cache.extract import import_features

    root, layout, _ = data
    env = environment(tmp_path)
    export(import_features(layout, dataset="csv", root=root, out=tmp_path / "a.h5").path, tmp_path / "out")
    sidecar = json.loads((tmp_path / "out" / "spml_cache.json").read_text())
    del sidecar["protocol"]  # as exports made before it was kept
    (tmp_path / "out" / "spml_cache.json").write_text(json.dumps(sidecar))
    monkeypatch.delenv("SPML_DATA", raising=False)
    code, err = run_main("import-features", str(tmp_path / "out"), "--out", str(tmp_path / "b.h5"), cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "pass --root DIR" in err and "export the cache again" in err
    done = run_cli("import-features", str(tmp_path / "out"), "--root", str(root), "--out", str(tmp_path / "b.h5"),
                   cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert f"matched {COUNT} of {COUNT} embedding rows to the images of csv by id" in done.stdout


def test_an_import_never_writes_over_the_cache_its_export_was_made_from(data, tmp_path, monkeypatch, capsys):
    """By default an export of cache/csv-imported-0.h5 comes back to that very path: refused, --force or not, and
    wherever the source was moved to (same cache id); --out elsewhere is the way on."""
    from spml_cache.extract import import_features

    root, layout, _ = data
    monkeypatch.setenv("SPML_CACHE", str(tmp_path / "cache"))
    source = import_features(layout, dataset="csv", root=root).path
    before = source.read_bytes()
    assert run_main("export", str(source), "--out", str(tmp_path / "out"), cwd=tmp_path, monkeypatch=monkeypatch,
                    capsys=capsys)[0] == 0
    done = run_cli("import-features", str(tmp_path / "out"), "--force", cwd=tmp_path, env=environment(tmp_path))
    assert done.returncode == 1, done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert f"{source} is the cache this export was made from" in line and "--out FILE" in line
    moved = tmp_path / "elsewhere.h5"
    source.rename(moved)
    code, err = run_main("import-features", str(tmp_path / "out"), "--out", str(moved), "--force", cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and f"{moved} is the cache this export was made from" in err
    assert moved.read_bytes() == before
    code, err = run_main("import-features", str(tmp_path / "out"), "--out", str(tmp_path / "copy.h5"), cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err


def test_an_export_of_another_dataset_than_dataset_says_which(data, tmp_path, monkeypatch, capsys):
    from spml_cache.extract import import_features

    root, layout, _ = data
    path = import_features(layout, dataset="csv", root=root, out=tmp_path / "a.h5").path
    assert run_main("export", str(path), "--out", str(tmp_path / "out"), cwd=tmp_path, monkeypatch=monkeypatch,
                    capsys=capsys)[0] == 0
    done = run_cli("import-features", str(tmp_path / "out"), "--dataset", "coco", cwd=tmp_path,
                   env=environment(tmp_path))
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "--dataset coco" in line and "spml_cache.json says this export is of csv" in line
    assert "pass --dataset csv" in line


def test_partial_labels_travel_through_an_export(tmp_path):
    """A cache whose labels are partial (label_mask) exported and imported back keeps which entries were
    annotated; restated here from the arrays written."""
    from spml_cache.cache.embeddings import export
    from spml_cache.extract import import_features

    rng = np.random.default_rng(1)

    def split(rows, observed=True):
        labels = (rng.random((rows, 3)) < 0.5).astype(np.uint8)
        labels[:, 0] = 1
        mask = (rng.random((rows, 3)) < 0.7).astype(np.uint8)
        mask[:, 0] = 1
        out = {"features": rng.standard_normal((rows, 4)).astype(np.float32), "labels": labels * mask,
               "ids": [f"{rows}-{k}.jpg" for k in range(rows)], "label_mask": mask}
        if observed:
            out["observed"] = np.eye(3, dtype=np.int8)[np.zeros(rows, dtype=int)]
        return out

    given = {"train": split(6), "val": split(3), "test": split(4, observed=False)}
    attrs = {"dataset": "csv", "classes": '["a", "b", "c"]', "num_classes": 3, "backbone": "resnet50",
             "resolution": 32, "split_seed": 1200, "val_frac": 0.2, "observe_seed": 1200, "num_pos": 1,
             "num_neg": 0, "expected_positives": 1.5}
    source = cache.write(tmp_path / "partial.h5", attrs=attrs, **given)
    export(source, tmp_path / "out")
    again = cache.load(import_features(tmp_path / "out", out=tmp_path / "again.h5").path)
    for name, arrays in given.items():
        np.testing.assert_array_equal(getattr(again, name).label_mask, arrays["label_mask"])
        np.testing.assert_array_equal(getattr(again, name).labels, arrays["labels"])


def _rewrite(layout: Path, index: int, **columns) -> None:
    table = pq.read_table(layout / "metadata" / f"metadata_{index}.parquet").to_pydict()
    table.update(columns)
    pq.write_table(pa.table(table), layout / "metadata" / f"metadata_{index}.parquet")


def _repeat(layout, root):
    paths = pq.read_table(layout / "metadata" / "metadata_1.parquet").column("image_path").to_pylist()
    _rewrite(layout, 1, image_path=[paths[0], *paths[:-1]])  # the first image twice, the last one gone


BROKEN = {
    "repeated": (_repeat, "image_path values name more than one embedding row"),
    "missing": (lambda layout, root: _rewrite(layout, 1, image_path=[f"elsewhere-{i}.jpg" for i in range(7)]),
                "have no embedding row by image_path"),
    "short metadata": (lambda layout, root: _rewrite(layout, 0, image_path=["a.jpg"] * 8, caption=["x"] * 8),
                       "metadata_0.parquet: 8 rows for the 9 of img_emb_0.npy"),
    "no partner": (lambda layout, root: (layout / "metadata" / "metadata_1.parquet").unlink(),
                   "img_emb_1.npy has no partner"),
    "no key column": (lambda layout, root: [pq.write_table(pa.table({"caption": ["x"] * n}), layout / "metadata" /
                                                           f"metadata_{i}.parquet") for i, n in ((0, 9), (1, 7))],
                      "no id or image_path column"),
    "not float": (lambda layout, root: np.save(layout / "img_emb" / "img_emb_0.npy", np.zeros((9, 2), np.int64)),
                  "img_emb_0.npy: int64 (9, 2), not a float"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_bad_layout_is_one_line_naming_it_and_nothing_is_written(data, tmp_path, monkeypatch, capsys, case):
    root, layout, _ = data
    damage, said = BROKEN[case]
    damage(layout, root)
    monkeypatch.setenv("SPML_CACHE", str(tmp_path / "cache"))
    code, err = run_main("import-features", str(layout), "--dataset", "csv", "--root", str(root), cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_the_layout_needs_root_and_takes_no_classes_file(data, tmp_path, monkeypatch, capsys):
    root, layout, _ = data
    monkeypatch.delenv("SPML_DATA", raising=False)
    code, err = run_main("import-features", str(layout), "--dataset", "csv", cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    assert code == 1 and "clip-retrieval layout: pass --root DIR" in err
    code, err = run_main("import-features", str(layout), "--dataset", "csv", "--root", str(root), "--classes",
                         "names.txt", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "--classes names.txt" in err and "leave --classes out" in err


def test_export_writes_over_nothing(data, tmp_path, monkeypatch, capsys):
    from spml_cache.extract import import_features

    root, layout, _ = data
    path = import_features(layout, dataset="csv", root=root, out=tmp_path / "a.h5").path
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    code, err = run_main("export", str(path), "--out", str(tmp_path / "taken"), cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "--out" in err and "not an empty folder" in err
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]
    assert not list(tmp_path.glob(".taken.tmp-*"))


def test_without_pyarrow_the_layout_says_how_to_install_it(monkeypatch):
    from spml_cache.cache import embeddings

    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(SpmlError, match=r'pip install "spml-cache\[parquet\]"'):
        embeddings.parquet()


def test_a_stop_during_export_leaves_nothing_and_says_so(data, tmp_path, monkeypatch):
    from spml_cache.cache import embeddings
    from spml_cache.extract import import_features
    from spml_cache.runtime.errors import Interrupted

    root, layout, _ = data
    path = import_features(layout, dataset="csv", root=root, out=tmp_path / "a.h5").path
    written = embeddings._write_metadata

    def stopped_after_the_first(file, name, split):  # Ctrl-C arrives while the second part is written
        if name == "val":
            raise KeyboardInterrupt
        written(file, name, split)

    monkeypatch.setattr(embeddings, "_write_metadata", stopped_after_the_first)
    with pytest.raises(Interrupted, match="nothing was written"):
        embeddings.export(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_every_part_of_an_export_reads_back_with_pyarrow_and_an_older_exports_null_fixed_lists_import(
        data, tmp_path):
    """Test's observed labels are null. An export wrote them as a null fixed-size list, which pyarrow before 26
    cannot read from parquet ("Expected all lists to be of size=3 but index 1 had size=0": apache/arrow issue
    35692; mlflow pins pyarrow below 26, so a tracker's install brought it back): now a plain list column that
    any pyarrow reads, and an import never reads test's observed column, so exports made before still import."""
    from spml_cache.extract import import_features

    root, layout, _ = data
    source = import_features(layout, dataset="csv", root=root, out=tmp_path / "source.h5").path
    done = run_cli("export", str(source), "--out", str(tmp_path / "out"), cwd=tmp_path, env=environment(tmp_path))
    assert done.returncode == 0, done.stderr
    original = cache.load(source)
    for index, name in enumerate(cache.SPLITS):
        table = pq.read_table(tmp_path / "out" / "metadata" / f"metadata_{index}.parquet")
        assert table.schema.field("observed").type == pa.list_(pa.int8())
        observed = getattr(original, name).observed
        assert table.column("observed").to_pylist() == ([None] * len(table) if observed is None else observed.tolist())
    older = tmp_path / "out" / "metadata" / "metadata_2.parquet"  # test's part as exports before this one wrote it
    table = pq.read_table(older)
    position = table.schema.get_field_index("observed")
    pq.write_table(table.set_column(position, "observed", pa.nulls(len(table), pa.list_(pa.int8(), len(CLASSES)))),
                   older)
    again = run_cli("import-features", str(tmp_path / "out"), "--out", str(tmp_path / "again.h5"), cwd=tmp_path,
                    env=environment(tmp_path))
    assert again.returncode == 0, again.stderr
    imported = cache.load(tmp_path / "again.h5")
    assert imported.test.observed is None and imported.test.ids == original.test.ids
    np.testing.assert_array_equal(imported.test.labels, original.test.labels)


def test_a_last4_cache_exported_comes_back_as_a_last4_cache(data, tmp_path):
    import h5py

    root, layout, _ = data
    env = environment(tmp_path)
    assert run_cli("import-features", str(layout), "--dataset", "csv", "--root", str(root), cwd=tmp_path,
                   env=env).returncode == 0
    source = tmp_path / "cache" / "csv-imported-0.h5"
    with h5py.File(source, "a") as file:  # as `extract --features last4` would have named its kind
        file.attrs["features"] = "last4"
    done = run_cli("export", str(source), "--out", str(tmp_path / "out"), cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    env["SPML_CACHE"] = str(tmp_path / "again")
    again = run_cli("import-features", str(tmp_path / "out"), "--dataset", "csv", "--root", str(root),
                    cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr
    imported = cache.load(tmp_path / "again" / "csv-imported_last4-0.h5")
    assert imported.attrs["features"] == "last4"


def dead_process_id() -> int:
    """The id of a process that has ended (and been reaped)."""
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_what_a_killed_export_left_is_removed_by_the_next(data, tmp_path):
    """An export killed with SIGKILL leaves its hidden `.OUT.tmp-PID` folder (beside a new --out, inside an empty
    one), which no run ever removed; the next export removes those of processes that no longer run, and leaves a
    running one's alone."""
    from spml_cache.extract import import_features

    root, layout, _ = data
    path = import_features(layout, dataset="csv", root=root, out=tmp_path / "a.h5").path
    (tmp_path / "empty").mkdir()
    running = tmp_path / f".new.tmp-{os.getpid()}"  # this process runs: an export of its own, say
    running.mkdir()
    for name, folder in (("new", tmp_path), ("empty", tmp_path / "empty")):
        killed = folder / f".{name}.tmp-{dead_process_id()}"
        (killed / "img_emb").mkdir(parents=True)
        (killed / "img_emb" / "img_emb_0.npy").write_bytes(b"\x93NUMPY half")
        done = run_cli("export", str(path), "--out", str(tmp_path / name), cwd=tmp_path, env=environment(tmp_path))
        assert done.returncode == 0, done.stderr
        assert not killed.exists()
        assert {p.name for p in (tmp_path / name).iterdir()} == {"img_emb", "metadata", "spml_cache.json"}
    assert running.is_dir()
