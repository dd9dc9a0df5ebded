#!/usr/bin/env bash
# The loss x backbone table of frozen features: for each backbone and feature kind, extract the dataset's cache
# and train every loss's linear probe on it, then `report --pivot backbone` (rows losses, columns backbone+kind)
# and its figure. What a user with a GPU and the backbones' weights runs.
#
#   SPML_DATA=~/data bash scripts/frozen_table.sh voc                      # the default backbones, pooled and last4
#   BACKBONES="resnet50 clip:ViT-B-16/openai" FEATURES=last4 bash scripts/frozen_table.sh coco
#   WDS=0,1e-4,1e-3 SEEDS=3 bash scripts/frozen_table.sh voc                # weight decay as a grid axis
#   DRY_RUN=1 bash scripts/frozen_table.sh voc                              # print the commands, run nothing
#   EXTRACT_ARGS="--weights none --resolution 64" LINEAR_ARGS="--epochs 2" LOSSES=an,role ...  # passed through
#
# One dataset per run of the script (the pivot compares backbones on one dataset); caches go to $SPML_CACHE (or
# ./cache) as <dataset>-<backbone slug>[_last4].h5, runs to RUNS (./runs), the table to frozen-<dataset>.md and
# the figure to FIGURES (./figures). The weights come from torch's and the Hugging Face hub's caches (fetched
# once where there is a network; SPML_OFFLINE=1 never fetches).
set -euo pipefail

dataset=${1:-voc}
backbones=${BACKBONES:-resnet50 convnext_base vit_b_16 timm:vit_base_patch14_dinov2.lvd142m clip:ViT-B-16/openai}
features=${FEATURES:-pooled last4}
seeds=${SEEDS:-1}
losses=${LOSSES:-all}
runs=${RUNS:-runs}
figures=${FIGURES:-figures}
cache_dir=${SPML_CACHE:-cache}
spml=${SPML:-spml-cache}

run() { echo "+ $*"; [ -n "${DRY_RUN:-}" ] || "$@"; }

wd=()
[ -n "${WDS:-}" ] && wd=(--wd "$WDS")
read -r -a extract_args <<< "${EXTRACT_ARGS:-}"
read -r -a linear_args <<< "${LINEAR_ARGS:-}"
for backbone in $backbones; do
  slug=${backbone//[-:\/]/_}  # the registry's slug: - : / as _
  for kind in $features; do
    suffix=""
    [ "$kind" = pooled ] || suffix="_$kind"
    cache="$cache_dir/$dataset-$slug$suffix.h5"
    run $spml extract "$dataset" --backbone "$backbone" --features "$kind" --out "$cache" \
      ${extract_args[@]+"${extract_args[@]}"}
    run $spml linear --cache "$cache" --loss "$losses" --seeds "$seeds" ${wd[@]+"${wd[@]}"} --out "$runs" \
      ${linear_args[@]+"${linear_args[@]}"}
  done
done
run $spml report "$runs/$dataset" --pivot backbone
run $spml report "$runs/$dataset" --pivot backbone --format md --out "frozen-$dataset.md" --plots "$figures"
