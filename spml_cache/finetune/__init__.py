"""Stage three: fine-tune ResNet-50 end to end from the best linear head (LinearInit) or a fresh head.

Its door is `finetune` (what `spml-cache finetune` calls); `FineTuneModel`, `make_optimizer` and `train_step`
are the model and one optimiser step, for tests and scripts.
"""

from spml_cache.finetune.run import finetune, make_optimizer, train_step
from spml_cache.finetune.settings import FinetuneSettings, FineTuneModel

__all__ = ["FineTuneModel", "FinetuneSettings", "finetune", "make_optimizer", "train_step"]
