"""The papers' published numbers (docs/protocol.md, "The numbers to reproduce"), which `report --paper` shows
next to ours.
"""

from __future__ import annotations

from spml_cache.report.collect import DATASET_LABELS

# The papers whose numbers the report quotes; a cell's source is "<key>, <table>".
PAPERS = {
    "Cole et al. 2021": "E. Cole, O. Mac Aodha, T. Lorieul, P. Perona, D. Morris, N. Jojic: Multi-Label Learning from"
                        " Single Positive Labels, CVPR 2021",
    "Zhou et al. 2022": "D. Zhou, P. Chen, Q. Wang, G. Chen, P.-A. Heng: Acknowledging the Unknown for Multi-label"
                        " Learning with Single Positive Labels, ECCV 2022",
    "Chen et al. 2024": "Y. Chen et al.: Boosting Single Positive Multi-label Classification with Generalized Robust"
                        " Loss, IJCAI 2024",
    "Li et al. 2023": "X. Li, X. Wang, S. Chen: Pushing One Pair of Labels Apart Each Time in Multi-Label Learning:"
                      " From Single Positive to Full Labels, arXiv 2302.14695",
}
# The papers' numbers (docs/protocol.md), in DATASET_LABELS order: (stage, loss) -> (paper, table, values).
_COLE, _ZHOU, _CHEN, _LI = PAPERS
PAPER = {
    ("linear", "bce"): (_COLE, "Table 1", (86.7, 70.0, 50.7, 29.1)),
    ("linear", "bce_ls"): (_COLE, "Table 1", (87.6, 70.2, 51.7, 29.3)),
    ("linear", "iun"): (_COLE, "Table 1", (86.4, 67.0, 49.0, 19.4)),
    ("linear", "an"): (_COLE, "Table 1", (84.2, 62.3, 46.2, 17.2)),
    ("linear", "an_ls"): (_COLE, "Table 1", (85.3, 64.8, 48.5, 15.4)),
    ("linear", "wan"): (_COLE, "Table 1", (84.1, 63.1, 45.8, 17.9)),
    ("linear", "epr"): (_COLE, "Table 1", (83.8, 62.6, 46.4, 18.0)),
    ("linear", "role"): (_COLE, "Table 1", (86.5, 66.3, 49.5, 16.2)),
    ("finetune", "role"): (_COLE, "Table 1, +LinearInit", (88.2, 69.0, 51.0, 16.8)),
    ("finetune", "an_ls"): (_COLE, "Table 1, +LinearInit", (86.5, 69.2, 50.5, 16.6)),
    ("finetune", "em"): (_ZHOU, "Table 1", (89.09, 70.70, 47.15, 20.85)),
    ("finetune", "em_apl"): (_ZHOU, "Table 1", (89.19, 70.87, 47.59, 21.84)),
    ("finetune", "gr"): (_CHEN, "Table 2", (89.83, 73.17, 49.08, 21.64)),
    ("finetune", "opml"): (_LI, "Table II", (87.77, 68.93, 47.93, 22.30)),
    ("finetune", "opml_sp"): (_LI, "Table II", (89.20, 71.75, 50.14, 24.11)),
}


def paper_number(stage: str, dataset: str, loss: str) -> tuple[float, str] | None:
    """The published test mAP for this loss, dataset and stage, with the seed table it comes from."""
    entry = PAPER.get((stage.split("-")[0], loss))
    if entry is None or dataset not in DATASET_LABELS:
        return None
    paper, table, values = entry
    return values[list(DATASET_LABELS).index(dataset)], f"{paper}, {table}"
