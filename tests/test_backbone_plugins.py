"""`--backbone module:callable` and the entry-point group `spml_cache.backbones`: the user's own backbone extracts
like a built-in, the cache records where its code came from, and a broken one is one line with nothing written."""

from __future__ import annotations

import hashlib
import json
import re
import sys

import h5py
import numpy as np
import pytest
from cli_support import REPO, run_cli, run_main
from PIL import Image

from spml_cache.images import IMAGENET_MEAN, IMAGENET_STD
from spml_cache.runtime.errors import SpmlError

SIDE = 8
# The user's module: the model is the mean of each normalised channel, so a solid-colour image's row is known.
NETS = """
import torch
from spml_cache.backbones.preprocess import Preprocess


def make():
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()), Preprocess({side}), 3


def sized(resolution=12):
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()), Preprocess(resolution), 3


def not_tuple():
    return torch.nn.Identity()


def not_module():
    return "model", Preprocess(8), 3


def wrong_width():
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()), Preprocess(8), 4


def raises():
    raise RuntimeError("no weights here")


def fetches():  # offline, as torch.hub's download fails: urllib's error around the resolver's
    import socket, urllib.error
    raise urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))


def fetches_unless_none(weights=None):
    if weights != "none":
        fetches()
    return make()


class Faulty(torch.nn.Module):
    # The channel means, then a fault: NaN rows (nan), or from its third call (the first is the width check, the
    # second the first batch) an error (raises) or rows twice as wide (widens).

    def __init__(self, fault):
        super().__init__()
        self.fault, self.calls = fault, 0

    def forward(self, x):
        self.calls += 1
        out = x.mean(dim=(2, 3))
        if self.fault == "nan":
            return out * float("nan")
        if self.calls >= 3 and self.fault == "raises":
            raise RuntimeError("the weights server went away")
        if self.calls >= 3 and self.fault == "widens":
            return torch.cat([out, out], dim=1)
        return out


def nan():
    return Faulty("nan"), Preprocess({side}), 3


def raises_later():
    return Faulty("raises"), Preprocess({side}), 3


def widens_later():
    return Faulty("widens"), Preprocess({side}), 3
"""
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (120, 120, 120), (250, 250, 10), (10, 240, 240),
           (90, 10, 160), (160, 90, 10), (60, 60, 60), (230, 230, 230)]


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A CSV dataset of solid-colour JPEGs (train 0-6, test 7-9) and a folder of the user's code (imported anew:
    an earlier test's copy of the module, from its own folder, leaves sys.modules)."""
    for name in ("tinynets37", "tinyerr37"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    lines = ["path,labels,split"]
    for number, colour in enumerate(COLOURS):
        (tmp_path / "images").mkdir(exist_ok=True)
        Image.new("RGB", (16 + number, 12), colour).save(tmp_path / "images" / f"{number}.jpg", quality=95)
        lines.append(f"images/{number}.jpg,{'a' if number % 2 else 'a|b'},{'test' if number >= 7 else 'train'}")
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    code = tmp_path / "code"
    code.mkdir()
    (code / "tinynets37.py").write_text(NETS.format(side=SIDE))
    (code / "tinyerr37.py").write_text("raise RuntimeError('broken at import')\n")
    return tmp_path


def write_distribution(code, name: str, value: str) -> None:
    """An installed distribution, as pip leaves it: a dist-info folder whose entry_points.txt names `value`."""
    info = code / "tinyplug37-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyplug37\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[spml_cache.backbones]\n{name} = {value}\n")


def expected_rows(ids: list[str]) -> np.ndarray:
    """Each image's solid colour on the 0..1 scale, normalised with ImageNet's mean and std: the channel means."""
    colours = np.array([COLOURS[int(image_id.split("/")[1].split(".")[0])] for image_id in ids]) / 255.0
    return ((colours - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)).astype(np.float32)


def extract(data, backbone: str, *more: str):
    env = {"PYTHONPATH": f"{REPO}:{data / 'code'}", "SPML_CACHE": str(data / "cache")}
    return run_cli("extract", "csv", "--root", str(data), "--backbone", backbone, "--device", "cpu", "--workers",
                   "0", *more, cwd=data, env=env)


def check_features(path) -> dict:
    with h5py.File(path, "r") as file:
        for split in ("train", "val", "test"):
            ids = [i.decode() for i in file[split]["ids"][()]]
            # JPEG keeps a solid colour within a level or two: 2/255/0.225 < 0.05
            np.testing.assert_allclose(file[split]["features"][()], expected_rows(ids), atol=0.05)
        return dict(file.attrs)


def test_a_module_callable_extracts_and_the_cache_records_its_file(data, monkeypatch, capsys):
    done = extract(data, "tinynets37:make")
    assert done.returncode == 0, done.stderr
    attrs = check_features(data / "cache" / f"csv-tinynets37_make-{SIDE}.h5")
    assert (attrs["backbone"], attrs["weights"], attrs["feature_dim"]) == ("tinynets37:make", "callable", 3)
    origin = json.loads(attrs["backbone_origin"])
    source = data / "code" / "tinynets37.py"
    assert origin == {"kind": "module", "spec": "tinynets37:make", "module": "tinynets37",
                      "path": str(source.resolve()), "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    # a record in the keys the code before the one loader wrote ("file" for "path") is the same backbone: the
    # cache is up to date, not rebuilt
    path = data / "cache" / f"csv-tinynets37_make-{SIDE}.h5"
    with h5py.File(path, "r+") as file:
        file.attrs["backbone_origin"] = json.dumps({**{k: v for k, v in origin.items() if k != "path"},
                                                    "file": origin["path"]}, sort_keys=True)
    written = path.stat().st_mtime_ns
    monkeypatch.syspath_prepend(str(data / "code"))
    monkeypatch.setenv("SPML_CACHE", str(data / "cache"))
    code, err = run_main("extract", "csv", "--root", str(data), "--backbone", "tinynets37:make", "--device", "cpu",
                         "--workers", "0", cwd=data, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and path.stat().st_mtime_ns == written, err
    # the same command after the file changed: another backbone, so another cache (refused without --force)
    source.write_text(source.read_text() + "# changed\n")
    again = extract(data, "tinynets37:make")
    assert again.returncode == 1 and "backbone_origin" in again.stderr and "--force" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


def test_an_entry_point_extracts_and_the_cache_records_its_distribution(data):
    write_distribution(data / "code", "tinynet37", "tinynets37:make")
    done = extract(data, "tinynet37")
    assert done.returncode == 0, done.stderr
    attrs = check_features(data / "cache" / f"csv-tinynet37-{SIDE}.h5")
    assert attrs["backbone"] == "tinynet37"
    source = data / "code" / "tinynets37.py"
    assert json.loads(attrs["backbone_origin"]) == {
        "kind": "entry_point", "spec": "tinynet37", "value": "tinynets37:make", "distribution": "tinyplug37",
        "version": "1.0", "path": str(source.resolve()), "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}


@pytest.mark.parametrize("backbone, more, said", [
    ("nosuchmod37.nets:make", [], "no module nosuchmod37 on the Python path"),
    ("nosuchmod37:make", [], "nor a module found on the path"),
    ("tinyerr37:make", [], "importing it raised RuntimeError: broken at import"),
    ("tinynets37:missing", [], "tinynets37 defines no missing; name a callable it defines"),
    ("tinynets37:not_tuple", [], "returned Identity, not a tuple of three"),
    ("tinynets37:not_module", [], "its model is a str, not a torch.nn.Module"),
    ("tinynets37:wrong_width", [], "maps a [1, 3, R, R] batch to (1, 3), not (1, 4)"),
    ("tinynets37:raises", [], "calling it raised RuntimeError: no weights here; fix the callable"),
    ("tinynets37:fetches", [], "calling it raised URLError: <urlopen error [Errno -3] Temporary failure in name"
     " resolution>; it found no network (fetching its weights?): give the callable a weights parameter, which"
     " --weights none reaches as 'none'"),
    ("tinynets37:fetches_unless_none", [], "it found no network (fetching its weights?): --weights PATH if it reads"
     " a local file, or --weights none (random features, to try the pipeline)"),
    ("tinynets37:make", ["--weights", "w.pth"], "takes no weights argument"),
    ("tinynets37:make", ["--resolution", "64"], "takes no resolution argument"),
    ("tinynets37:make", ["--features", "last4"], "is a plugin backbone (its callable gives one vector); use"
     " --features pooled"),
])
def test_a_broken_plugin_is_one_line_naming_it_and_nothing_is_written(data, monkeypatch, capsys, backbone, more,
                                                                     said):
    monkeypatch.syspath_prepend(str(data / "code"))
    monkeypatch.setenv("SPML_CACHE", str(data / "cache"))
    code, err = run_main("extract", "csv", "--root", str(data), "--backbone", backbone, "--device", "cpu",
                         "--workers", "0", *more, cwd=data, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and said in err and backbone.split(":")[0] in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (data / "cache").exists() or not any((data / "cache").iterdir())


def test_the_way_out_named_to_an_offline_plugin_works(data, monkeypatch):
    from spml_cache import backbones

    monkeypatch.syspath_prepend(str(data / "code"))
    assert backbones.describe("tinynets37:fetches_unless_none", weights="none").feature_dim == 3


def test_a_resolution_the_callable_takes_is_passed_to_it(data, monkeypatch):
    from spml_cache import backbones

    monkeypatch.syspath_prepend(str(data / "code"))
    assert backbones.describe("tinynets37:sized").resolution == 12  # its own default
    assert backbones.describe("tinynets37:sized", resolution=20).resolution == 20


def test_an_entry_point_named_like_a_torchvision_model_is_refused(data, monkeypatch):
    from spml_cache import backbones

    write_distribution(data / "code", "resnet18", "tinynets37:make")
    monkeypatch.syspath_prepend(str(data / "code"))
    with pytest.raises(SpmlError, match="pass tv:resnet18 for torchvision's, or tinynets37:make"):
        backbones.describe("resnet18")
    assert backbones.describe("tv:resnet18", weights="none").backbone == "resnet18"


def test_finetune_refuses_a_plugin_whose_file_changed_since_the_cache(data, monkeypatch):
    from spml_cache import backbones
    from spml_cache.finetune.start import trunk_backbone

    monkeypatch.syspath_prepend(str(data / "code"))
    attrs = backbones.describe("tinynets37:make").attrs()
    assert trunk_backbone(attrs, "callable", SIDE).origin == attrs["backbone_origin"]
    source = data / "code" / "tinynets37.py"
    source.write_text(source.read_text() + "# changed\n")
    before = json.loads(attrs["backbone_origin"])["sha256"][:16]
    now = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    with pytest.raises(SpmlError, match=f"not the code that made the cache .sha256 {before} then, {now} now:"
                                        f" {source.resolve()}"):
        trunk_backbone(attrs, "callable", SIDE)


def test_a_file_callable_extracts_from_any_folder_and_finetune_finds_it_from_another(data, monkeypatch, capsys):
    from spml_cache.finetune.start import trunk_backbone

    monkeypatch.setenv("SPML_CACHE", str(data / "cache"))  # the file alone: its folder is not on the path
    code, err = run_main("extract", "csv", "--root", str(data), "--backbone", "code/tinynets37.py:make", "--device",
                         "cpu", "--workers", "0", cwd=data, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    attrs = check_features(data / "cache" / f"csv-tinynets37.py_make-{SIDE}.h5")  # known by the file's name
    source = (data / "code" / "tinynets37.py").resolve()
    assert (attrs["backbone"], attrs["weights"]) == ("tinynets37.py:make", "callable")
    assert json.loads(attrs["backbone_origin"]) == {"kind": "file", "spec": f"{source}:make", "path": str(source),
                                                    "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    monkeypatch.chdir(data / "images")  # another folder: the recorded path finds the file
    assert trunk_backbone(attrs, "callable", SIDE).backbone == "tinynets37.py:make"


def test_finetune_reads_an_earlier_record_and_names_the_recorded_file_when_its_module_is_not_found(data,
                                                                                                   monkeypatch):
    from spml_cache import backbones
    from spml_cache.finetune.start import trunk_backbone

    monkeypatch.syspath_prepend(str(data / "code"))
    attrs = backbones.describe("tinynets37:make").attrs()
    now = json.loads(attrs["backbone_origin"])
    old = {"kind": "module", "spec": "tinynets37:make", "module": "tinynets37", "file": now["path"],
           "sha256": now["sha256"]}  # the keys the code before the one loader wrote
    assert trunk_backbone({**attrs, "backbone_origin": json.dumps(old)}, "callable", SIDE).backbone == "tinynets37:make"
    gone = {**old, "spec": "gone37:make", "module": "gone37", "file": "/nowhere/gone37.py"}
    with pytest.raises(SpmlError) as error:
        trunk_backbone({**attrs, "backbone": "gone37:make", "backbone_origin": json.dumps(gone)}, "callable", SIDE)
    assert str(error.value) == (
        f"finetune: the cache's backbone gone37:make (gone37:make, /nowhere/gone37.py, sha256 {now['sha256'][:12]})"
        " cannot be loaded here: its module gone37 is not on the Python path here: run from /nowhere, or add that"
        " folder to PYTHONPATH")


def test_the_guides_example_runs_offline_from_the_folder_that_holds_it_with_weights_none(data):
    """docs/your-own-backbone.md's mynets.py, as a user pastes it beside them: `--weights none` reaches its
    `weights` parameter as the string 'none' (no download), the module is found from the current folder."""
    guide = (REPO / "docs" / "your-own-backbone.md").read_text()
    code = guide.split("```python file=mynets.py\n", 1)[1].split("```", 1)[0]
    (data / "mynets.py").write_text(code)
    env = {"PYTHONPATH": str(REPO), "SPML_CACHE": str(data / "cache")}
    done = run_cli("extract", "csv", "--root", ".", "--backbone", "mynets:resnet18_trunk", "--weights", "none",
                   "--resolution", "32", "--device", "cpu", "--workers", "0", cwd=data, env=env)
    assert done.returncode == 0, done.stderr
    with h5py.File(data / "cache" / "csv-mynets_resnet18_trunk-32.h5", "r") as file:
        assert (file.attrs["weights"], file.attrs["feature_dim"], file.attrs["resolution"]) == ("none", 512, 32)
        assert np.isfinite(file["train"]["features"][()]).all()


def extract_in_process(data, monkeypatch, capsys, backbone: str, *more: str) -> tuple[int, str]:
    monkeypatch.syspath_prepend(str(data / "code"))
    monkeypatch.setenv("SPML_CACHE", str(data / "cache"))
    return run_main("extract", "csv", "--root", str(data), "--backbone", backbone, "--device", "cpu", "--workers",
                    "0", "--batch-size", "2", *more, cwd=data, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("function, said", [
    ("raises_later", "it raised RuntimeError: the weights server went away"),
    ("widens_later", "it returned rows of width 6, not its 3"),
])
def test_a_backbone_failing_mid_run_is_one_line_naming_it_and_the_run_goes_on(data, monkeypatch, capsys, function,
                                                                              said):
    """Its second batch raising, or coming back wider: raw errors naming neither the backbone nor what was kept (a
    width change was even written, rows cut to the first width)."""
    backbone, partial = f"tinynets37:{function}", data / "cache" / f"csv-tinynets37_{function}-{SIDE}.h5.partial"
    for kept in (2, 4):  # the same command again goes on from the rows kept (and fails at its own second batch)
        code, err = extract_in_process(data, monkeypatch, capsys, backbone)
        assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert re.fullmatch(rf"error: backbone {backbone} failed on a batch of train images \(the first: \S+\.jpg\):"
                            rf" {re.escape(said)}; fix it, then run the command again \(the {kept} images done are"
                            rf" kept in {re.escape(str(partial))}, and go on with the fixed code where it gives the"
                            r" last of them the same features\)", err.strip()), err
        assert sorted(path.name for path in (data / "cache").iterdir()) == [partial.name]


@pytest.mark.parametrize("on_bad_image", ["fail", "skip"])
def test_a_backbone_giving_nan_is_its_fault_not_the_images(data, monkeypatch, capsys, on_bad_image):
    """Every row NaN: the error blamed an image, and with --on-bad-image skip a "complete" cache of no rows was
    sealed, exit 0, every image "undecodable"."""
    code, err = extract_in_process(data, monkeypatch, capsys, "tinynets37:nan", "--on-bad-image", on_bad_image)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert re.match(r"error: backbone tinynets37:nan gave features that are not finite \(NaN or inf\) for image"
                    r" \S+\.jpg and 1 more of its batch: the backbone is at fault, not the images: check its --weights"
                    r" or its code", err), err
    assert not (data / "cache" / f"csv-tinynets37_nan-{SIDE}.h5").exists()


def test_a_cache_whose_every_image_was_left_out_is_never_sealed(data, monkeypatch, capsys):
    for image in (data / "images").iterdir():
        image.write_bytes(image.read_bytes()[:20])  # truncated: undecodable
    code, err = extract_in_process(data, monkeypatch, capsys, "tinynets37:make", "--on-bad-image", "skip")
    partial = data / "cache" / f"csv-tinynets37_make-{SIDE}.h5.partial"
    assert code == 1 and [line for line in err.splitlines() if line.startswith("error")] == [  # after the progress
        f"error: {partial}: every one of the 6 train images was left out as undecodable (e.g. images/0.jpg), so the"
        " cache would have no train rows: check the images under --root, then run the command again with --force"
    ], err
    assert not partial.with_suffix("").exists()


def test_a_backbone_fixed_after_it_failed_goes_on_from_the_images_done(data, monkeypatch, capsys):
    """The fault's line says to fix the backbone and run the command again; the fix changes its file's hash, and the
    same command was refused with a 500-character line of backbone-origin JSON ending "pass --force", which throws
    the images done away (issue 56). A fix that leaves their features as they were keeps them; one that changes
    them is refused in one readable line, the kept rows never mixed with another network's."""
    backbone, module = "tinynets37:raises_later", data / "code" / "tinynets37.py"
    code, err = extract_in_process(data, monkeypatch, capsys, backbone)
    assert code == 1 and "(the 2 images done are kept in " in err, err
    source = module.read_text()
    unchanged = source.replace('raise RuntimeError("the weights server went away")', "return out")
    changed = unchanged.replace("out = x.mean(dim=(2, 3))", "out = 2 * x.mean(dim=(2, 3))")
    partial = data / "cache" / f"csv-tinynets37_raises_later-{SIDE}.h5.partial"
    module.write_text(changed)  # a "fix" that is another network: the kept rows are not its
    monkeypatch.delitem(sys.modules, "tinynets37")
    code, err = extract_in_process(data, monkeypatch, capsys, backbone)
    (line,) = err.strip().splitlines()
    assert code == 1 and line.startswith(f"error: {partial} was started with other code of the backbone {backbone}"
                                         " (sha256 "), line
    assert line.endswith("which gives other features for the images done: restore that code to go on, or pass"
                         " --force to start over (its 2 images are extracted again)") and "{" not in line, line
    module.write_text(unchanged)  # the fix: the same features for every image, and no fault
    monkeypatch.delitem(sys.modules, "tinynets37")
    from spml_cache.extract import extract as extract_api  # the same command, through the door that returns its report

    report = extract_api("csv", data, backbone=backbone, device="cpu", workers=0, batch_size=2)
    assert report.resumed == 2 and report.status == "written"
    assert any(note.startswith(f"the backbone {backbone}'s code changed since {partial} was started (sha256 ")
               and note.endswith("it gives the same features for the last 2 images done, so the 2 done are kept")
               for note in report.notes), report.notes
    attrs = check_features(report.path)
    assert json.loads(attrs["backbone_origin"])["sha256"] == hashlib.sha256(unchanged.encode()).hexdigest()
