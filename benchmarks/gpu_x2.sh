#!/usr/bin/env bash
# GPU evidence on a two-GPU machine (nvidia-h200-x2) in one call: install, then sections of
# benchmarks/gpu_suite.sh on both GPUs, then one list per GPU, run side by side.
# Everything ends up in one archive, $OUT/evidence.tgz: a device call returns only its first files.
# Usage: OUT=dir bash benchmarks/gpu_x2.sh "<sections on both>" "<GPU 0 sections>" "<GPU 1 sections>" [seconds per GPU]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PIECEWORKS_CACHE_ROOT=${PIECEWORKS_CACHE_ROOT:-/tmp/pw_cache}
suite=benchmarks/gpu_suite.sh
both=$1 gpu0=$2 gpu1=$3 seconds=${4:-480}
work=$(mktemp -d)
mkdir -p "$work/both" "$work/gpu0" "$work/gpu1"
pack() { tar -czf "$OUT/evidence.tgz" -C "$work" .; }
on_gpu() {  # gpu, sections
  [ -n "$2" ] || return 0
  CUDA_VISIBLE_DEVICES=$1 OUT=$work/gpu$1 timeout "$seconds" bash $suite $2 > "$work/gpu$1/run.log" 2>&1
}
OUT=$work/both bash $suite install versions $both > "$work/both/run.log" 2>&1
pack
on_gpu 0 "$gpu0" &
on_gpu 1 "$gpu1"
wait
pack
grep -h "^=== \|ms/step\|passed\|failed\|x floor\|wall \|linear " "$work"/*/run.log | cut -c1-220
