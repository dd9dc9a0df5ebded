"""`--log wandb`: one Weights & Biases run per run directory, in the project WANDB_PROJECT (default `spml-cache`),
its files in RUN/wandb (unless WANDB_DIR says elsewhere); `WANDB_MODE=offline` writes it there alone, for
`wandb sync`; WANDB_RUN_GROUP, WANDB_ENTITY and the other WANDB_* variables mean what W&B says they do.

The run is named as its directory, its job type is the stage; its config is the options; per head
`<result>/<head>/train_loss` and `<result>/<head>/val_map`, against `epoch` (a panel section per result); its
summary holds each result's test metrics (`<result>/test_map`, ...) and selected config (`<result>/selected`); the
run's files are an artifact of type `run-directory`. A resumed run goes on in the same W&B run (its id, kept in
trackers.json; offline, a second folder of the same id, which `wandb sync` uploads after the first).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from spml_cache.trackers.base import Epoch, Outcome, RunInfo, Tracker, TrackerFailed

DEFAULT_PROJECT = "spml-cache"
LOCAL_MODES = ("offline", "disabled", "dryrun")


class WandB(Tracker):
    name = "wandb"

    def start(self, run: RunInfo, record: dict) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or record.get("mode") or "online"  # a resumed run: as it began
        if mode not in LOCAL_MODES and not wandb.login(prompt=False, verify=False):
            raise TrackerFailed("no W&B login: run `wandb login` (or set WANDB_API_KEY), or log offline with"
                                " WANDB_MODE=offline")
        self.run_info = run
        # the run directory's own id: a start cut short before trackers.json kept it finds the same W&B run again
        record.setdefault("id", hashlib.sha256(str(run.run_dir.resolve()).encode()).hexdigest()[:12])
        record.setdefault("project", os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT)
        folder = None if os.environ.get("WANDB_DIR") else str(run.run_dir)
        self.run = wandb.init(
            project=record["project"], id=record["id"], resume="allow", mode=mode, name=run.name, job_type=run.stage,
            tags=[run.stage, run.dataset], config={**run.options, "run": run.tags}, dir=folder,
            settings=wandb.Settings(silent=True, console="off", disable_git=True, save_code=False))
        record["mode"] = self.run.settings.mode
        record.setdefault("folders", []).append(str(Path(self.run.dir).parent.resolve()))
        self.run.define_metric("epoch")
        self.run.define_metric("*", step_metric="epoch")

    def epochs(self, epochs: list[Epoch]) -> None:
        """One history row per epoch number, every head's values of that epoch in it."""
        rows: dict[int, dict] = {}
        for epoch in epochs:
            row = rows.setdefault(epoch.epoch, {"epoch": epoch.epoch})
            row.update({f"{epoch.head.key}/{epoch.head.name}/{name}": value for name, value in epoch.values.items()})
        for _, row in sorted(rows.items()):
            self.run.log(row)
        self.took(epochs)

    def finish(self, outcome: Outcome) -> str:
        import wandb

        for key, result in outcome.results.items():
            self.run.summary.update({f"{key}/{name}": value for name, value in result.metrics.items()})
            self.run.summary[f"{key}/selected"] = result.selected if result.selected is not None else {
                "error": result.error}
        artifact = wandb.Artifact(re.sub(r"[^\w.-]", "_", self.run_info.name), type="run-directory")
        for path in outcome.files:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)
        offline = self.run.settings.mode in LOCAL_MODES
        url = None if offline else self.run.url  # offline, asking for it prints a warning
        self.run.finish()
        if not offline:
            return f"wandb: run {self.run.id}: {url}"
        folders = Path(self.run.dir).parent.parent / f"offline-run-*-{self.run.id}"  # a resumed run's each
        return f"wandb: offline run {self.run.id} in {folders}; upload it with: wandb sync {folders}"

    def stop(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 130)
