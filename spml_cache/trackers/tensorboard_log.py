"""`--log tensorboard`: the run's event files in RUN/tensorboard (`tensorboard --logdir RUN/tensorboard`), through
PyTorch's `SummaryWriter`.

One TensorBoard run per run directory (a resumed run adds an event file to the same folder, which TensorBoard reads
as one run): per head its curves as `<result>/train_loss/<head>` and `<result>/val_map/<head>` (step: the epoch),
drawn together per result in the Custom Scalars tab; the selected config's test metrics as
`<result>/selected/<metric>` and its settings as text; the options as the HParams tab's hyperparameters, with
each result's test mAP as its metrics. Values are written as float64 tensors: what TensorBoard holds is what the
run wrote, bit for bit.
"""

from __future__ import annotations

import json
import re

from spml_cache.trackers.base import Epoch, Outcome, RunInfo, Tracker

FOLDER = "tensorboard"


def _scalar_param(value):
    """A hyperparameter as the HParams tab takes one: a number, a boolean or text."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


class TensorBoard(Tracker):
    name = "tensorboard"

    def start(self, run: RunInfo, record: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run, self.keys = run, set()
        self.logdir = run.run_dir / FOLDER
        self.writer = SummaryWriter(str(self.logdir))
        if not record.get("logdir"):  # a new run: its settings once (a resumed one has them in its first file)
            self.writer.add_text("options", "\n".join(f"    {key} = {value}" for key, value in run.params.items()))
            self.writer.add_text("run", "\n".join(f"    {key} = {value}" for key, value in run.tags.items()))
        record["logdir"] = str(self.logdir.resolve())
        self.writer.flush()

    def _scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)

    def epochs(self, epochs: list[Epoch]) -> None:
        for epoch in epochs:
            for metric, value in epoch.values.items():
                self._scalar(f"{epoch.head.key}/{metric}/{epoch.head.name}", value, epoch.epoch)
        if {epoch.head.key for epoch in epochs} - self.keys:
            self.keys |= {epoch.head.key for epoch in epochs}
            self._layout()
        self.writer.flush()
        self.took(epochs)

    def _layout(self) -> None:
        """The Custom Scalars tab: per result, every head's val mAP in one chart, and its train loss in another."""
        self.writer.add_custom_scalars({
            key: {"val mAP per head": ["Multiline", [f"^{re.escape(key)}/val_map/"]],
                  "train loss per head": ["Multiline", [f"^{re.escape(key)}/train_loss/"]]}
            for key in sorted(self.keys)})

    def finish(self, outcome: Outcome) -> str:
        from torch.utils.tensorboard.summary import hparams

        for key, result in outcome.results.items():
            for metric, value in result.metrics.items():
                self._scalar(f"{key}/selected/{metric}", value, 0)
            said = result.selected if result.selected is not None else {"error": result.error}
            self.writer.add_text(f"{key}/selected", f"    {json.dumps(said)}")
        metrics = {f"{key}/selected/test_map": result.metrics["test_map"] for key, result in outcome.results.items()
                   if "test_map" in result.metrics}
        # The HParams tab's session: the summaries written into this folder (SummaryWriter.add_hparams would make
        # a folder of its own, another TensorBoard run beside this one).
        for summary in hparams({key: _scalar_param(value) for key, value in self.run.params.items()}, metrics):
            self.writer.file_writer.add_summary(summary)
        self.writer.close()
        return f"tensorboard: tensorboard --logdir {self.logdir}"

    def stop(self, failed: bool) -> None:
        self.writer.close()
