#!/usr/bin/env bash
# Reproduce the papers' tables with spml-cache: Table 1 of Cole et al. (linear heads on frozen features, and
# fine-tuned from them with LinearInit) and the fine-tuned numbers of the EM/EM+APL, GR and OPML papers.
#
#   SPML_DATA=~/data bash scripts/reproduce_table1.sh            # voc coco nus cub, every stage
#   SPML_DATA=~/data bash scripts/reproduce_table1.sh voc        # one dataset
#   STAGES="extract linear report" SEEDS=1 bash scripts/reproduce_table1.sh voc
#   DRY_RUN=1 bash scripts/reproduce_table1.sh                   # print the commands, run nothing
#
# $SPML_DATA holds one folder per dataset (voc/, coco/, nus/, cub/; the layouts are in `spml-cache datasets`).
# Stages one and three need ImageNet ResNet-50 weights in torch's cache, or WEIGHTS=PATH.pth. Stage three wants
# a GPU; for several: FINETUNE="torchrun --nproc-per-node 4 -m spml_cache". FINETUNE_LOSSES picks its losses.
# Stage three starts as each paper did (docs/protocol.md, "The numbers to reproduce"): Cole et al.'s "+LinearInit"
# rows (an_ls, role; LINEAR_INIT) from the best linear head (--init best); Zhou et al.'s, Chen et al.'s and Li et
# al.'s losses end to end from ImageNet with a fresh head (--init imagenet).
set -euo pipefail

datasets=("$@")
[ ${#datasets[@]} -eq 0 ] && datasets=(voc coco nus cub)
stages=" ${STAGES:-extract linear finetune report} "
seeds=${SEEDS:-3}
finetune_losses=${FINETUNE_LOSSES:-an_ls role em em_apl gr opml opml_sp}
linear_init=" ${LINEAR_INIT:-an_ls role} "
spml=${SPML:-spml-cache}
finetune=${FINETUNE:-$spml}

run() { echo "+ $*"; [ -n "${DRY_RUN:-}" ] || "$@"; }

for dataset in "${datasets[@]}"; do
  missing=()
  [ "$dataset" = nus ] && missing=(--skip-missing)  # many of NUS-WIDE's Flickr images are gone
  weights=()
  [ -n "${WEIGHTS:-}" ] && weights=(--weights "$WEIGHTS")
  if [[ $stages == *" extract "* ]]; then
    run $spml extract "$dataset" ${weights[@]+"${weights[@]}"} ${missing[@]+"${missing[@]}"}
  fi
  if [[ $stages == *" linear "* ]]; then
    run $spml linear --dataset "$dataset" --loss all --seeds "$seeds"
  fi
  if [[ $stages == *" finetune "* ]]; then
    for loss in $finetune_losses; do
      init=imagenet
      [[ $linear_init == *" $loss "* ]] && init=best
      run $finetune finetune --init "$init" --dataset "$dataset" --loss "$loss" --seeds "$seeds" \
        ${weights[@]+"${weights[@]}"} ${missing[@]+"${missing[@]}"}
    done
  fi
done
if [[ $stages == *" report "* ]]; then
  run $spml report --paper
  run $spml report --paper --format md --out table1.md --plots figures
fi
