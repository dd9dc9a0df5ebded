"""Run directories (docs/internals.md, "run directories"): the one owner of their files, for both training
stages. `files.py`: atomic files; `layout.py`: where each file goes and what it holds (`start_run`,
`finish_run`); `reading.py`: finished results and `--resume`; `handover.py`: the head a later stage starts from;
`results.py`: a finished run's results typed (`LinearRun`, `FinetuneRun`, each result a `LossResult`; `load_run`).
"""

from spml_cache.runs.files import (
    append_metrics,
    jsonable,
    load_checkpoint,
    read_json,
    read_metrics,
    read_npz,
    replace_atomically,
    save_checkpoint,
    temporary_path,
    watch_metrics,
    write_json,
    write_npz,
)
from spml_cache.runs.handover import (
    LinearHead, best_loss, check_same_cache, newest_run, other_cache, read_linear_head,
)
from spml_cache.runs.layout import (
    RESULTS,
    TEST_LABELS,
    SeedScores,
    env_info,
    file_stem,
    finish_run,
    make_run_dir,
    safe_name,
    scores_path,
    start_run,
    write_labels,
    write_scores,
)
from spml_cache.runs.reading import (
    StoredTest, image_ranking_precision, is_complete, load_results, open_for_resume, open_record, read_stored_test, run_stamp,
)
from spml_cache.runs.results import FinetuneRun, LinearRun, LossResult, StageRun, load_run

__all__ = [
    "FinetuneRun", "LinearHead", "LinearRun", "LossResult", "RESULTS", "StageRun", "SeedScores", "StoredTest",
    "TEST_LABELS", "append_metrics", "best_loss", "check_same_cache", "env_info", "file_stem", "finish_run",
    "image_ranking_precision", "is_complete", "jsonable", "load_checkpoint", "load_results", "load_run",
    "make_run_dir", "newest_run", "open_for_resume", "open_record", "other_cache", "read_json", "read_linear_head",
    "read_metrics", "read_npz", "read_stored_test", "replace_atomically", "run_stamp", "safe_name",
    "save_checkpoint", "scores_path", "start_run", "temporary_path", "watch_metrics", "write_json", "write_labels",
    "write_npz", "write_scores",
]
