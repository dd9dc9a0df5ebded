#!/usr/bin/env bash
# What only a GPU can check, grouped so that each part fits one call of a lent GPU machine (10 minutes a call):
#
#   bash scripts/gpu_checks.sh tests     # the `cuda` test tier: extract, linear (graphs vs eager), finetune, demo
#   bash scripts/gpu_checks.sh linear    # stage two, VOC-shaped: graphs vs --no-graphs for an and role, the
#                                        # reference loop, then --loss all with graphs (the targets)
#   bash scripts/gpu_checks.sh coco      # stage two, COCO-shaped: --loss all with graphs
#   bash scripts/gpu_checks.sh extract   # stage one: 10,000 JPEGs at 448 px, end to end vs decode vs trunk
#
# Run from the repository root (the machine needs no network: PYTHONPATH=. instead of an install). Logs go to
# $OUT (or gpu-out/), the benchmark JSON to docs/benchmarks/ and a copy to $OUT; docs/benchmarks.md quotes them.
set -uo pipefail
export PYTHONPATH=.
out=${OUT:-gpu-out}
mkdir -p "$out"
slug=$(python3 -c "import re, torch; print(re.sub('[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$out/gpu.txt"

case "${1:-tests}" in
  tests)
    python3 -m pytest -m cuda -q -x -p no:cacheprovider 2>&1 | tee "$out/pytest-cuda.txt"
    ;;
  linear)
    python3 scripts/bench_linear.py --device cuda --shape voc --losses an,role --eager --reference-epochs 1 \
      --json "docs/benchmarks/linear-voc-$slug.json" 2>&1 | tee "$out/bench-linear-voc.txt"
    python3 scripts/bench_linear.py --device cuda --shape voc --losses all --no-reference \
      --json "docs/benchmarks/linear-voc-all-$slug.json" 2>&1 | tee "$out/bench-linear-voc-all.txt"
    cp docs/benchmarks/linear-voc-*"$slug".json "$out/"
    ;;
  coco)
    python3 scripts/bench_linear.py --device cuda --shape coco --losses all --no-reference \
      --json "docs/benchmarks/linear-coco-all-$slug.json" 2>&1 | tee "$out/bench-linear-coco.txt"
    cp "docs/benchmarks/linear-coco-all-$slug.json" "$out/"
    ;;
  extract)
    python3 scripts/bench_extract.py --device cuda --baseline --json "docs/benchmarks/extract-$slug.json" 2>&1 \
      | tee "$out/bench-extract.txt"
    cp "docs/benchmarks/extract-$slug.json" "$out/"
    ;;
  *)
    echo "usage: bash scripts/gpu_checks.sh tests|linear|coco|extract" >&2
    exit 2
    ;;
esac
