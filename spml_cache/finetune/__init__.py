"""Stage three: fine-tune a backbone's trunk end to end from the best linear head (LinearInit) or a fresh head.

Its door is `run_finetune(FinetuneOptions(...), FinetunePlacement(...)) -> FinetuneRun` (what `spml-cache finetune`
calls); `finetune(init=..., loss=..., root=...)` is the same by keywords, for the Python API. `FineTuneModel`,
`Training`, `make_optimizer` and `train_step` are the model and one optimiser step, for tests and scripts.
`sc.finetune(...)` (face.py: keywords named as the flags) is this package called.
"""

from spml_cache.finetune.run import FinetuneRun, finetune, run_finetune
from spml_cache.finetune.model import FineTuneModel
from spml_cache.finetune.settings import FinetuneSettings
from spml_cache.finetune.step import Training, make_optimizer, train_step
from spml_cache.options import FinetuneOptions, FinetunePlacement
from spml_cache.finetune.face import finetune as face_door
from spml_cache.options.keywords import callable_stage

__all__ = ["FineTuneModel", "FinetuneOptions", "FinetunePlacement", "FinetuneRun", "FinetuneSettings", "Training",
           "finetune", "make_optimizer", "run_finetune", "train_step"]

callable_stage(__name__, face_door)
