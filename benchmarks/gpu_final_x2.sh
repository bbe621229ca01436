#!/usr/bin/env bash
# The next GPU evidence runs on a two-GPU machine (nvidia-h200-x2), in two calls of < 10 minutes.
#   call a: both GPUs: install, the Bamba TP test; then GPU 0 runs the whole GPU test suite while
#           GPU 1 profiles FP8 and Bamba and benchmarks Bamba.
#   call b: GPU 0: the GEMV micro-benchmark and the 8B benchmark with the Triton GEMV; GPU 1: the
#           8B benchmark with max-autotune at sizes 1 and 64.
# Everything ends up in one archive, $OUT/evidence.tgz: a call returns only its first few files.
# Usage: OUT=dir bash benchmarks/gpu_final_x2.sh a|b
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
export PYTHONUNBUFFERED=1 PIECEWORKS_CACHE_ROOT=${PIECEWORKS_CACHE_ROOT:-/tmp/pw_cache}
suite=benchmarks/gpu_suite.sh
work=$(mktemp -d)
mkdir -p "$work/both" "$work/gpu0" "$work/gpu1"
pack() { tar -czf "$OUT/evidence.tgz" -C "$work" .; }
on_gpu() {  # gpu, seconds, sections...
  local gpu=$1 seconds=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu OUT=$work/gpu$gpu timeout "$seconds" bash $suite "$@" \
    > "$work/gpu$gpu/run.log" 2>&1
}
OUT=$work/both bash $suite install versions > "$work/both/run.log" 2>&1
case ${1:-a} in
  a) OUT=$work/both timeout 150 bash $suite tpbamba >> "$work/both/run.log" 2>&1
     pack
     on_gpu 0 400 tests &
     on_gpu 1 400 benchbamba profilebamba profilefp8
     wait ;;
  b) on_gpu 0 500 gemv bench8bgemv &
     on_gpu 1 500 autotune8b
     wait ;;
  *) echo "usage: $0 a|b"; exit 2 ;;
esac
pack
grep -h "^=== \|ms/step\|passed\|failed\|x floor\|wall " "$work"/*/run.log | cut -c1-200
