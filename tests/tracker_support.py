"""The trackers' own stores read back with each tool's own reader, and what the run directory says they should hold.

- TensorBoard: `EventAccumulator` over RUN/tensorboard (every event file of it, as TensorBoard reads a folder).
- MLflow: a real `mlflow server` on 127.0.0.1 (a free port, a sqlite backend, artifacts served by it), started and
  stopped here, read back with `MlflowClient`; or any tracking URI.
- W&B: an offline run's `.wandb` files, records in W&B's own protobuf (`wandb.proto`). W&B 0.31 ships no Python
  reader of the file itself: its container is LevelDB's log format (32 KiB blocks of records with a 7-byte header:
  CRC-32 of the type byte and data, length, type FULL/FIRST/MIDDLE/LAST), read here with the CRC checked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from spml_cache import runs

# --- what the run directory holds --------------------------------------------------------------------------


def stored_options(config: dict) -> dict:
    """The options config.json keeps, restated: each declared option of the run's stage under its own name."""
    from spml_cache.options import FinetuneOptions, LinearOptions

    declared = (LinearOptions if config["stage"] == "linear" else FinetuneOptions).declared()
    return {name: value for name, value in config.items() if name in declared}


def flat_params(options: dict, prefix: str = "") -> dict:
    """config.json's options as the trackers' parameters, restated: nested keys joined by dots, lists as comma
    text, None and empty mappings as `none`."""
    found = {}
    for name, value in options.items():
        if isinstance(value, dict) and value:
            found.update(flat_params(value, f"{prefix}{name}."))
        elif isinstance(value, list):
            found[f"{prefix}{name}"] = ",".join(map(str, value)) or "none"
        else:
            found[f"{prefix}{name}"] = "none" if value is None or value == {} else value
    return found


def head_key(line: dict) -> tuple[str, str]:
    """(result key, head name) of a metrics line, restated here: `lr_0.01-bs_4-seed_0` (+ wd and swept values)."""
    key = line["loss"] if line.get("rule", "single") == "single" else f"{line['loss']}@{line['rule']}"
    parts = [f"lr_{float(line['lr'])!r}", *([f"wd_{float(line['wd'])!r}"] if "wd" in line else []),
             f"bs_{line['batch_size']}", f"seed_{line['seed']}",
             *(f"{k}_{v!r}" for k, v in (line.get("hparams") or {}).items())]
    return key, "-".join(parts)


def epoch_values(run_dir: Path) -> dict[tuple[str, str, str, int], float]:
    """{(result key, head, metric, epoch): value} of metrics.jsonl's train losses and val mAPs (the diverged
    epoch's nulls left out): what every tracker must hold, each once."""
    found = {}
    for line in runs.read_metrics(run_dir):
        key, head = head_key(line)
        for metric in ("train_loss", "val_map"):
            if line.get(metric) is not None:
                assert (key, head, metric, line["epoch"]) not in found, line
                found[key, head, metric, line["epoch"]] = line[metric]
    return found


def sklearn_f1_family(scores: np.ndarray, labels: np.ndarray, top_k: int | None = None) -> dict[str, float]:
    """The F1 family restated with scikit-learn: a label is predicted when it scores 0.5 or more (and, with
    `top_k`, is among the image's k highest); CP, CR: macro precision and recall (0 where undefined); CF1 their
    harmonic mean (ML-GCN's definition); OP, OR, OF1: the micro averages."""
    from sklearn.metrics import f1_score, precision_score, recall_score

    predicted = scores >= 0.5
    if top_k is not None:
        ranks = np.argsort(np.argsort(-scores, axis=1, kind="stable"), axis=1)
        predicted &= ranks < top_k
    kinds = dict(y_true=labels, y_pred=predicted.astype(int), zero_division=0)
    cp, cr = (100 * score(average="macro", **kinds) for score in (precision_score, recall_score))
    suffix = "" if top_k is None else f"@{top_k}"
    return {f"cp{suffix}": cp, f"cr{suffix}": cr, f"cf1{suffix}": 2 * cp * cr / (cp + cr) if cp + cr else 0.0,
            f"op{suffix}": 100 * precision_score(average="micro", **kinds),
            f"or{suffix}": 100 * recall_score(average="micro", **kinds),
            f"of1{suffix}": 100 * f1_score(average="micro", **kinds)}


def result_values(run_dir: Path) -> dict[str, dict[str, float]]:
    """{result key: {metric: value}}: results.json's mAPs as written, and the F1 family of each seed's stored
    test scores (report's `seed_values`, the numbers `spml-cache report --metric` shows), mean over seeds."""
    from spml_cache.report.measures import seed_values

    found = {}
    for key, entry in runs.load_results(run_dir)["losses"].items():
        values = {name: entry[name] for name in ("val_map", "val_map_std", "test_map", "test_map_std", "train_map")
                  if entry.get(name) is not None}
        stored = runs.read_stored_test(run_dir, key)
        values.update({name: float(np.mean(seeds)) for name, seeds in seed_values(stored).items()})
        found[key] = values
    return found


def assert_f1_family_is_sklearns(run_dir: Path, values: dict[str, dict[str, float]]) -> None:
    """The F1 family the trackers got against scikit-learn's on the stored test scores, mean over the seeds."""
    for key, metrics in values.items():
        stored = runs.read_stored_test(run_dir, key)
        for top_k in (None, 3):
            seeds = [sklearn_f1_family(scores, np.asarray(stored.labels), top_k) for scores in stored.scores]
            for name in seeds[0]:
                value = float(np.mean([seed[name] for seed in seeds]))
                assert abs(metrics[name] - value) < 1e-9, (key, name, metrics[name], value)


# --- TensorBoard -------------------------------------------------------------------------------------------


def read_tensorboard(logdir: Path) -> SimpleNamespace:
    """Every scalar of the folder as {tag: [(step, value)]} (float64 tensors, so exact), its texts, and its
    HParams session's hyperparameters."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    events.Reload()
    scalars, texts = {}, {}
    for tag in events.Tags()["tensors"]:
        plugin = events.SummaryMetadata(tag).plugin_data.plugin_name
        values = [(event.step, tensor_util.make_ndarray(event.tensor_proto)) for event in events.Tensors(tag)]
        if plugin == "scalars":
            scalars[tag] = [(step, float(value)) for step, value in values]
        elif plugin == "text":
            texts[tag.removesuffix("/text_summary")] = values[-1][1].item().decode()
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = {key: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
               for key, value in start.session_start_info.hparams.items()}
    return SimpleNamespace(scalars=scalars, texts=texts, hparams=hparams, files=sorted(logdir.glob("events.*")))


# --- MLflow ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_mlflow_server(folder: Path, timeout: float = 300) -> SimpleNamespace:
    """`mlflow server` on 127.0.0.1 at a free port, its store a sqlite file in `folder`, its artifacts served by
    it (clients upload them over HTTP); one worker, no job runner: the least a test needs. Returns its URI and
    process (its own process group: `stop_mlflow_server` ends the server and its workers)."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
               "--artifacts-destination", str(folder / "artifacts")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(folder / "server.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri, began = f"http://127.0.0.1:{port}", time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    return SimpleNamespace(uri=uri, process=process, folder=folder, log=log)
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() - began > timeout:
            stop_mlflow_server(SimpleNamespace(process=process, log=log))
            raise RuntimeError(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
        time.sleep(0.25)


def stop_mlflow_server(server: SimpleNamespace) -> None:
    """SIGKILL to the server's process group (its workers too): a server gone at once, as a crash leaves it."""
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)
    server.log.close()


class SharedServer:
    """A test module's mlflow server (its start takes ~10-30 s on two cores): started when a test first asks for
    it, and again when a test has ended it (the test of a server gone mid-run kills the one it is given)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.current, self.started = folder, None, 0

    def alive(self) -> SimpleNamespace:
        if self.current is None or self.current.process.poll() is not None:
            if self.current is not None:
                stop_mlflow_server(self.current)
            self.started += 1
            self.current = start_mlflow_server(self.folder / f"server-{self.started}")
        return self.current

    def close(self) -> None:
        if self.current is not None:
            stop_mlflow_server(self.current)


def read_mlflow(uri: str, experiment: str) -> SimpleNamespace:
    """The experiment's parent runs (one per run directory) and, for the one parent, its child runs by name with
    every metric's history as [(step, value)], and the parent's artifacts."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    every = client.search_runs([found.experiment_id], max_results=10_000)
    parents = [run for run in every if "mlflow.parentRunId" not in run.data.tags]
    assert len(parents) == 1, [run.info.run_name for run in parents]
    (parent,) = parents
    children = {}
    for run in every:
        if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id:
            assert run.info.run_name not in children, run.info.run_name  # one child a head
            histories = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                         for key in run.data.metrics}
            children[run.info.run_name] = SimpleNamespace(run=run, histories=histories)
    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id)}
    return SimpleNamespace(client=client, parent=parent, children=children, artifacts=artifacts)


# --- W&B ---------------------------------------------------------------------------------------------------

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every record of a `.wandb` file, as `wandb.proto.wandb_internal_pb2.Record`s."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", raw[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    records, pending, position = [], b"", 7
    while position + 7 <= len(raw):
        left = BLOCK - position % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        checksum, length, kind = struct.unpack("<IHB", raw[position:position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        data = raw[position + 7:position + 7 + length]
        assert zlib.crc32(data, zlib.crc32(bytes([kind]))) == checksum, f"{path}: a record's CRC does not match"
        position += 7 + length
        pending = data if kind in (FULL, FIRST) else pending + data
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def read_wandb(folder: Path) -> SimpleNamespace:
    """An offline run (every `offline-run-*` folder of it under `folder`, a resumed run's too, in order): its id,
    config, history rows (each a {key: value}), final summary and artifacts' files."""
    runs_found = sorted(folder.glob("offline-run-*"))
    assert runs_found, f"no offline W&B run under {folder}"
    ids, config, rows, summary, artifacts = set(), {}, [], {}, {}
    for run_folder in runs_found:
        (file,) = run_folder.glob("*.wandb")
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "history":
                rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                             for item in record.history.item})
            elif kind == "summary":
                summary.update({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                                for item in record.summary.update})
            elif kind == "artifact":
                contents = record.artifact.manifest.contents
                artifacts[record.artifact.name] = {entry.path: entry.digest for entry in contents}
    return SimpleNamespace(folders=runs_found, ids=ids, config=config, rows=rows, summary=summary, artifacts=artifacts)


def md5_base64(path: Path) -> str:
    """A file's digest as a W&B artifact manifest writes it (base64 of the MD5)."""
    import base64
    import hashlib

    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def wandb_folders(tmp_path: Path) -> dict:
    """W&B offline, its own folders (staged artifacts, cache, settings) in the test's folder, not the user's home."""
    return {"WANDB_MODE": "offline", **{f"WANDB_{kind}_DIR": str(tmp_path / f"wandb-{kind.lower()}")
                                       for kind in ("DATA", "CACHE", "CONFIG")}}


# --- each tracker against the run directory ----------------------------------------------------------------


def assert_tensorboard_holds(run_dir: Path, config: dict) -> None:
    board = read_tensorboard(run_dir / "tensorboard")
    expected = epoch_values(run_dir)
    curves = {tag: points for tag, points in board.scalars.items() if "/selected/" not in tag}
    assert len(curves) == len({(key, head, metric) for key, head, metric, _ in expected})
    for (key, head, metric, epoch), value in expected.items():
        points = curves[f"{key}/{metric}/{head}"]
        assert [step for step, _ in points] == sorted({step for step, _ in points}), points  # each epoch once
        assert dict(points)[epoch] == value
    for key, metrics in result_values(run_dir).items():
        assert {name: board.scalars[f"{key}/selected/{name}"][-1][1] for name in metrics} == metrics
        entry = runs.load_results(run_dir)["losses"][key]
        assert json.loads(board.texts[f"{key}/selected"]) == {**entry["selected"], "best_epoch": entry["best_epoch"]}
    params = flat_params(stored_options(config))
    assert board.hparams == {key: value if isinstance(value, (str, bool)) else float(value) for key, value in
                             params.items()}


def assert_mlflow_holds(run_dir: Path, uri: str, experiment: str, config: dict) -> None:
    found = read_mlflow(uri, experiment)
    parent = found.parent
    assert parent.info.run_name == run_dir.name and parent.info.status == "FINISHED"
    assert parent.data.params == {key: str(value) for key, value in flat_params(stored_options(config)).items()}
    assert parent.data.tags["run_dir"] == str(run_dir.resolve())
    expected = epoch_values(run_dir)
    heads = {(key, head) for key, head, _, _ in expected}
    assert set(found.children) == {f"{key} {head}" for key, head in heads}
    for (key, head, metric, epoch), value in expected.items():
        child = found.children[f"{key} {head}"]
        history = child.histories[metric]
        assert sorted(step for step, _ in history) == sorted({step for step, _ in history}), history  # once each
        assert dict(history)[epoch] == value
        assert child.run.info.status == "FINISHED" and child.run.data.params["seed"] == head.split("seed_")[1]
    results = runs.load_results(run_dir)["losses"]
    for key, metrics in result_values(run_dir).items():
        assert {name: parent.data.metrics[f"{key}/{name}".replace("@", "_at_")] for name in metrics} == metrics
        selected = {name for name, child in found.children.items() if child.run.data.tags.get("selected") == "true"
                    and name.startswith(f"{key} ")}
        entry = results[key]
        config_name = f"lr_{entry['selected']['lr']!r}-bs_{entry['selected']['batch_size']}-"
        assert len(selected) == len(entry["per_seed"]) and all(config_name in name for name in selected)
    assert found.artifacts == {"config.json", "env.json", "metrics.jsonl", "results.json"}
    with tempfile.TemporaryDirectory() as folder:
        copy = found.client.download_artifacts(parent.info.run_id, "results.json", folder)
        assert Path(copy).read_bytes() == (run_dir / "results.json").read_bytes()


def assert_wandb_holds(run_dir: Path, config: dict, folders: int) -> None:
    found = read_wandb(run_dir / "wandb")
    record = runs.read_json(run_dir / "trackers.json")["wandb"]
    assert len(found.folders) == folders and found.ids == {record["id"]}  # a resumed run: the same W&B run
    options = stored_options(config)
    assert {key: found.config[key] for key in options} == options
    logged = {}
    for row in found.rows:
        for name, value in row.items():
            if name.count("/") == 2:
                assert (name, row["epoch"]) not in logged, (name, row["epoch"])  # each epoch once
                logged[name, row["epoch"]] = value
    expected = epoch_values(run_dir)
    assert logged == {(f"{key}/{head}/{metric}", epoch): value
                      for (key, head, metric, epoch), value in expected.items()}
    for key, metrics in result_values(run_dir).items():
        assert {name: found.summary[f"{key}/{name}"] for name in metrics} == metrics
    (files,) = found.artifacts.values()
    assert files == {name: md5_base64(run_dir / name) for name in ("config.json", "env.json", "metrics.jsonl",
                                                                   "results.json")}
