#!/usr/bin/env bash
# What only a GPU can check, in parts that each fit one call of a lent GPU machine (10 minutes a call, one H100):
#
#   part            what                                                       expected on one H100 (CPU stand-in)
#   tests-extract   cuda tier, stage one: tests/test_extract_gpu.py (the       3-5 min: 1,000 images at 448 px on the
#                   nvjpeg race harness, 1,000 images at 448 px fp16 vs the    GPU in seconds (twice: nvjpeg and
#                   CPU's fp32 rows, padding, feed thread; the trunk on the    --decode cpu), their CPU fp32
#                   CPU's pixels in fp32/fp16/bf16, --decode cpu caches vs     reference ~35-70 s on 16 cores (4
#                   the CPU's) and the fp32 recompute of test_extract_finite   images/s on 2 cores here, 0.25 s each)
#   tests-linear    cuda tier, stage two: tests/test_cuda_graphs.py (graphs    2-4 min (the same checks on the CPU's
#                   vs eager for every loss, both fidelities, steps under      graph stand-in, tests/test_linear_
#                   sync debug mode "error", no recapture without a stop)      graphs.py: 20-45 s on 2 cores)
#   tests-pipeline  cuda tier, end to end: tests/test_cuda.py (600 demo        3-5 min (the demo alone: 46 s on 2
#                   images at 448 px: extract, linear vs CPU on learnable      CPU cores at 64 px)
#                   features, finetune's epoch 0 on a bf16 cache, demo)
#   linear          stage two, VOC-shaped: an and role with graphs and         2-4 min (CPU: an 12 s, role 29 s, all
#                   --no-graphs, the reference loop (1 epoch), all with graphs 7 min with 2 worker processes;
#                   in both fidelities (--fidelity authors: heads stop early,  H200 2026-11-26: all 16.9 s, authors
#                   their stacks capture anew into their pools, issue 42)      failed there in 11 s, 49 s eagerly)
#   coco-1..coco-3  stage two, COCO-shaped (65,665 training rows, 80 classes)  2-4 min each, 6-10 min for all 26
#                   --loss all with graphs, as three runs of 8-9 losses each   losses (CPU: ~10 min per loss)
#   extract         stage one: 10,000 JPEGs at 448 px, end to end vs decode    3-5 min (CPU: 1 image/s end to end)
#                   vs trunk, and the path without padding and feed thread
#   decode          --decode's two choices: bench_decode.py (nvjpeg's rate,    2-4 min (CPU decoder here: 150-185
#                   the CPU decoder's per core) and bench_extract.py --decode  images/s per core at 448 px, decode
#                   cpu end to end on 4,000 JPEGs (gpu's is `extract`'s)       and resize; 8 workers ~1,200-1,500)
#   all             every part above in turn (only where one command may run longer than 10 minutes)
#
# The expected GPU times are estimates from issue 14's H100 probes (a captured step 100-240 us, 23 stacks' VOC epoch
# in 0.585 s on streams) and issue 15's extraction figures; the CPU figures are docs/benchmarks.md's. Each part is
# bounded by `timeout` below its call's limit, so that what it measured comes back: pytest prints its summary
# line (also kept in $OUT/pytest-<part>-summary.txt) and bench_linear.py rewrites its JSON after every run.
#
# Run from the repository root (the machine needs no network: PYTHONPATH=. instead of an install). Logs go to
# $OUT (or gpu-out/), the benchmark JSON to docs/benchmarks/ and a copy to $OUT; docs/benchmarks.md quotes them.
set -uo pipefail
parts="tests-extract tests-linear tests-pipeline linear coco-1 coco-2 coco-3 extract decode"
if [[ " $parts all " != *" ${1:-none} "* ]]; then
  echo "usage: bash scripts/gpu_checks.sh ${parts// /|}|all" >&2
  exit 2
fi
export PYTHONPATH=.
out=${OUT:-gpu-out}
limit_s=${PART_LIMIT_S:-560}  # under the device call's 600 s, to leave time for the copies
mkdir -p "$out"
slug=$(python3 -c "import re, torch; print(re.sub('[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, torchvision, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'torchvision', torchvision.__version__, 'numpy', numpy.__version__)" >> "$out/gpu.txt"

# COCO's 27 losses (all but those that read a text side) in three runs of about equal work (ROLE and the weight penalties are the heaviest steps)
COCO_1=role+l1r+l2r+bce+bce_ls+iun+an+an_ls+an_ls_neg
COCO_2=opml_sp+em_apl+wan+entmin+pr+epr+em+focal+asl
COCO_3=hill+splc+ll_r+ll_ct+ll_cp+gr+zlpr+opml+bce_observed+crisp

cuda_tests() {  # part name, test files: every test runs (no -x), each result printed as it ends
  local part=$1
  shift
  timeout --signal=INT --kill-after=20 "$limit_s" python3 -m pytest -m cuda -n 8 -v -p no:cacheprovider --durations=0 "$@" \
    2>&1 | tee "$out/pytest-$part.txt"
  grep -E "^=+ .*(passed|failed|error|skipped|no tests ran).* =+$" "$out/pytest-$part.txt" | tail -1 \
    | tee "$out/pytest-$part-summary.txt"
}

bench_coco() {  # part name, losses joined by +
  timeout --signal=INT --kill-after=20 "$limit_s" python3 scripts/bench_linear.py --device cuda --shape coco \
    --losses "$2" --no-reference --json "docs/benchmarks/linear-$1-$slug.json" 2>&1 | tee "$out/bench-linear-$1.txt"
  cp "docs/benchmarks/linear-$1-$slug.json" "$out/" 2>/dev/null
}

run_part() {
  case "$1" in
    tests-extract) cuda_tests tests-extract tests/test_extract_gpu.py tests/test_extract_finite.py ;;
    tests-linear) cuda_tests tests-linear tests/test_cuda_graphs.py ;;
    tests-pipeline) cuda_tests tests-pipeline tests/test_cuda.py ;;
    linear)
      timeout --signal=INT --kill-after=20 "$limit_s" bash -c "
        python3 scripts/bench_linear.py --device cuda --shape voc --losses an,role --eager --reference-epochs 1 \
          --json docs/benchmarks/linear-voc-$slug.json 2>&1 | tee $out/bench-linear-voc.txt
        python3 scripts/bench_linear.py --device cuda --shape voc --losses all --no-reference \
          --json docs/benchmarks/linear-voc-all-$slug.json 2>&1 | tee $out/bench-linear-voc-all.txt
        python3 scripts/bench_linear.py --device cuda --shape voc --losses all --fidelity authors --no-reference \
          --json docs/benchmarks/linear-voc-all-authors-$slug.json 2>&1 | tee $out/bench-linear-voc-all-authors.txt"
      cp docs/benchmarks/linear-voc-*"$slug".json "$out/" 2>/dev/null
      ;;
    coco-1) bench_coco coco-1 "$COCO_1" ;;
    coco-2) bench_coco coco-2 "$COCO_2" ;;
    coco-3) bench_coco coco-3 "$COCO_3" ;;
    extract)
      timeout --signal=INT --kill-after=20 "$limit_s" python3 scripts/bench_extract.py --device cuda --baseline \
        --json "docs/benchmarks/extract-$slug.json" 2>&1 | tee "$out/bench-extract.txt"
      cp "docs/benchmarks/extract-$slug.json" "$out/" 2>/dev/null
      ;;
    decode)
      timeout --signal=INT --kill-after=20 "$limit_s" bash -c "
        python3 scripts/bench_decode.py --device cuda --images 2048 --json docs/benchmarks/decode-$slug.json \
          2>&1 | tee $out/bench-decode.txt
        python3 scripts/bench_extract.py --device cuda --decode cpu --images 4000 --variants '' \
          --json docs/benchmarks/extract-decode-cpu-$slug.json 2>&1 | tee $out/bench-extract-decode-cpu.txt"
      cp docs/benchmarks/decode-"$slug".json docs/benchmarks/extract-decode-cpu-"$slug".json "$out/" 2>/dev/null
      ;;
    all)
      limit_s=$((limit_s * 4))
      for part in $parts; do
        run_part "$part"
      done
      ;;
  esac
}

run_part "$1"
