"""Stage three: fine-tune ResNet-50 end to end from the best linear head (LinearInit) or a fresh head.

Its door is `run_finetune(FinetuneOptions(...), FinetuneRun(...))` (what `spml-cache finetune` calls);
`finetune(init=..., loss=..., root=...)` is the same by keywords, for the Python API. `FineTuneModel`,
`Training`, `make_optimizer` and `train_step` are the model and one optimiser step, for tests and scripts.
"""

from spml_cache.finetune.run import finetune, run_finetune
from spml_cache.finetune.settings import FinetuneOptions, FinetuneRun, FinetuneSettings, FineTuneModel
from spml_cache.finetune.step import Training, make_optimizer, train_step

__all__ = ["FineTuneModel", "FinetuneOptions", "FinetuneRun", "FinetuneSettings", "Training", "finetune",
           "make_optimizer", "run_finetune", "train_step"]
