"""`--log mlflow`: the run at MLflow's tracking URI (MLFLOW_TRACKING_URI, else MLflow's default), in the
experiment MLFLOW_EXPERIMENT_NAME (or MLFLOW_EXPERIMENT_ID; default `spml-cache`), through `MlflowClient`.

MLflow's way with a grid search: a parent run per run directory (its name; the options as parameters, what it
trains on as tags; each result's test metrics, `<result>/test_map`, ...; the run's files as artifacts) and a
nested child run per head (its lr, batch size, seed, ... as parameters; `train_loss` and `val_map` per epoch),
so that MLflow's run table, charts and parallel coordinates compare the heads; the selected config's heads carry
the tag `selected=true`. Keys take MLflow's characters only (`an@entry:0.1` is `an_at_entry:0.1`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time

from spml_cache.trackers.base import Epoch, Outcome, RunInfo, Tracker, TrackerFailed

DEFAULT_EXPERIMENT = "spml-cache"
# MLflow's own defaults retry a request for minutes, print each run's URL and log its database's set-up to the
# terminal; here a gone server is one line within seconds (the training never waits for it) and the command
# prints its own lines. Each stays the user's to set.
QUIET = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
         "MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
         "MLFLOW_LOGGING_LEVEL": "ERROR"}
# What MLflow's client says (after its retries) when nothing answers at the tracking URI.
UNREACHABLE = ("Max retries exceeded", "Failed to establish a new connection", "Connection refused",
               "Connection aborted", "Read timed out")
BATCH = 100  # MLflow takes at most 100 parameters or tags, and 1000 metrics, in one call


def key_text(text: str) -> str:
    """A name as an MLflow key: `@` as `_at_`, any other character MLflow refuses as `_`."""
    return re.sub(r"[^/\w.\- :]", "_", text.replace("@", "_at_"))


def _quiet() -> None:
    for name, value in QUIET.items():
        os.environ.setdefault(name, value)
    retries = logging.getLogger("urllib3.connectionpool")  # "Retrying (...)" on each failed request
    if retries.level == logging.NOTSET:
        retries.setLevel(logging.ERROR)


class MLflow(Tracker):
    name = "mlflow"

    def start(self, run: RunInfo, record: dict) -> None:
        _quiet()
        import mlflow
        from mlflow.tracking import MlflowClient

        self.run, self.record = run, record
        self.uri = record.get("tracking_uri") or mlflow.get_tracking_uri()  # a resumed run: where it began
        try:
            self.client = MlflowClient(self.uri)
        except mlflow.exceptions.MlflowException as err:
            if "MLFLOW_ALLOW_FILE_STORE" not in str(err):
                raise
            raise TrackerFailed(f"MLflow {mlflow.__version__} refuses the file store {self.uri} unless"
                                " MLFLOW_ALLOW_FILE_STORE=true is set; or track to a database, e.g."
                                " MLFLOW_TRACKING_URI=sqlite:///mlflow.db") from None
        self.children: dict = record.setdefault("children", {})
        if not record.get("run_id"):
            experiment, name = self._experiment()
            found = self._parent_of(experiment, run)
            parent = found or self.client.create_run(experiment, run_name=run.name, tags={
                key_text(key): value for key, value in run.tags.items()}).info.run_id
            record.update(tracking_uri=self.uri, experiment_id=experiment, experiment=name, run_id=parent)
            self._params(parent, run.params)  # again for a found one: the same values are no change to MLflow
            if found is None:
                return
        self.client.update_run(record["run_id"], status="RUNNING")
        self._found_children()

    def _parent_of(self, experiment: str, run: RunInfo) -> str | None:
        """The run's parent where the server has one that trackers.json does not name (a stop came between its
        making and the ledger's write, or the ledger is gone): the one tagged with this run directory."""
        where = run.tags["run_dir"]
        if "'" in where:  # not to be quoted in a filter: made again rather
            return None
        found = self.client.search_runs([experiment], f"tags.run_dir = '{where}'", max_results=1)
        return found[0].info.run_id if found else None

    def _experiment(self) -> tuple[str, str]:
        """(id, name) of the experiment the run goes into (made when it is not there)."""
        given = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if given:
            return given, self.client.get_experiment(given).name
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        found = self.client.get_experiment_by_name(name)
        return (found.experiment_id if found is not None else self.client.create_experiment(name)), name

    def _params(self, run_id: str, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(key_text(key), str(value)) for key, value in params.items()]
        for first in range(0, len(items), BATCH):
            self.client.log_batch(run_id, params=items[first:first + BATCH])

    def _found_children(self) -> None:
        """A resumed run's child runs as the server has them: one made just before the run stopped may be missing
        from trackers.json, and is taken again, not made twice."""
        parent, token = self.record["run_id"], None
        while True:
            page = self.client.search_runs([self.record["experiment_id"]], f"tags.mlflow.parentRunId = '{parent}'",
                                           max_results=1000, page_token=token)
            for child in page:
                self.children.setdefault(child.data.tags.get("head", ""), child.info.run_id)
            token = page.token
            if not token:
                return

    def _child(self, epoch: Epoch) -> str:
        """The head's child run, made with its parameters when its first epoch comes."""
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        head = epoch.head
        if head.id not in self.children:
            child = self.client.create_run(self.record["experiment_id"], run_name=f"{head.key} {head.name}",
                                           tags={MLFLOW_PARENT_RUN_ID: self.record["run_id"], "result": head.key,
                                                 "head": head.id})
            self._params(child.info.run_id, head.params)
            self.children[head.id] = child.info.run_id
        return self.children[head.id]

    def epochs(self, epochs: list[Epoch]) -> None:
        """Per head: its child run (made at its first epoch), its epochs in one call, the child ended with the
        head's last epoch; each head's epochs counted as logged once the server has them."""
        from mlflow.entities import Metric

        now, by_head = int(time.time() * 1000), {}
        for epoch in epochs:
            by_head.setdefault(epoch.head.id, []).append(epoch)
        for head_epochs in by_head.values():
            if self.stopping.is_set():
                return  # the rest is a resume's to send
            child = self._child(head_epochs[0])
            metrics = [Metric(name, value, now, epoch.epoch) for epoch in head_epochs
                       for name, value in epoch.values.items()]
            for first in range(0, len(metrics), 10 * BATCH):
                self.client.log_batch(child, metrics=metrics[first:first + 10 * BATCH])
            if head_epochs[-1].last:  # a head's run ends with its last epoch, as the head does
                self.client.set_terminated(child, "FINISHED")
            self.took(head_epochs)

    def finish(self, outcome: Outcome) -> str:
        from mlflow.entities import Metric, RunTag

        parent, now = self.record["run_id"], int(time.time() * 1000)
        metrics = [Metric(key_text(f"{key}/{name}"), value, now, 0)
                   for key, result in outcome.results.items() for name, value in result.metrics.items()]
        tags = [RunTag(key_text(f"{key}/selected"), json.dumps(result.selected if result.selected is not None
                                                               else {"error": result.error}))
                for key, result in outcome.results.items()]
        for first in range(0, max(len(metrics), len(tags)), BATCH):
            self.client.log_batch(parent, metrics=metrics[first:first + BATCH], tags=tags[first:first + BATCH])
        for key, result in outcome.results.items():
            for head in result.heads:
                if f"{key}/{head}" in self.children:
                    self.client.set_tag(self.children[f"{key}/{head}"], "selected", "true")
        for path in outcome.files:
            self.client.log_artifact(parent, str(path))
        self.client.set_terminated(parent, "FINISHED")
        experiment = self.record["experiment_id"]
        if self.uri.startswith(("http://", "https://")):
            return f"mlflow: {self.uri.rstrip('/')}/#/experiments/{experiment}/runs/{parent}"
        return (f"mlflow: run {parent} of experiment {self.record.get('experiment', experiment)} in {self.uri} (mlflow"
                f" ui --backend-store-uri {self.uri})")

    def stop(self, failed: bool) -> None:
        self.client.set_terminated(self.record["run_id"], "FAILED" if failed else "KILLED")

    def explain(self, err: Exception) -> str | None:
        text = str(err)
        if any(sign in text for sign in UNREACHABLE):
            where = getattr(self, "uri", "the tracking URI")
            return f"{where} does not answer (is the server up? MLFLOW_TRACKING_URI says where it is)"
        return None
