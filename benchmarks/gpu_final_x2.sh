#!/usr/bin/env bash
# The two-GPU evidence run (issue 10, plus the FP8 and remaining GPU tests on the spare GPU):
# both GPUs: install, the tensor-parallel GPU tests, the TP=2 8B benchmark; then, in parallel,
# GPU 0: the TP=1 8B benchmark and the GPU test suite, GPU 1: the FP8 GPU tests.
# Usage (on a 2-GPU machine): OUT=dir bash benchmarks/gpu_final_x2.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
export PYTHONUNBUFFERED=1
suite=benchmarks/gpu_suite.sh
mkdir -p "$OUT/both" "$OUT/gpu0" "$OUT/gpu1"
OUT=$OUT/both timeout 280 bash $suite install versions tp benchtp2
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 timeout 290 bash $suite benchtp1 resttests > "$OUT/gpu0/run.log" 2>&1 &
gpu0=$!
CUDA_VISIBLE_DEVICES=1 OUT=$OUT/gpu1 timeout 290 bash $suite fp8tests > "$OUT/gpu1/run.log" 2>&1
wait $gpu0
tail -n 30 "$OUT/gpu0/run.log" "$OUT/gpu1/run.log"
