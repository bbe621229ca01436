#!/usr/bin/env bash
# SPEC section 6's held rows, measured for this tree and, with OLD=dir, for another checkout of
# pieceworks (an older commit, e.g. `git worktree add /tmp/old <commit>`) in the same call, each
# row old then new back to back, so that a change is judged against the code before it on the
# same machine.
#
# Usage: OUT=dir [OLD=dir] bash benchmarks/held_rows.sh [rows...]
#   rows (default: all, in this order): small 8b fp8 bamba startup
#     small    llama-125m and the SmolLM2 shape, batch 1 and 8 (step against device-busy time),
#              and llama-125m batch 8, in 32 / out 128 end to end
#     8b       Llama-3.1-8B shape bf16, batch 1 and 64, context 1k, FULL_AND_PIECEWISE
#     fp8      the same with --quantization fp8
#     bamba    Bamba-9B shape, batch 1
#     startup  the 8B shape's cold and warm start-up (fresh processes; bytecode compiled first)
#   OUT: where the JSON and logs go, `<row>_new.json` and `<row>_old.json` (default /tmp/held)
# Each tree runs from its own directory (PYTHONPATH set to it) with its own compile cache. No
# peers are run (`gpu_suite.sh` runs them); the floor is measured in every bench run.
# The table of the latency rows is printed last (benchmarks/perf_table.py).
set -uo pipefail
cd "$(dirname "$0")/.."
NEW=$PWD
OUT=${OUT:-/tmp/held}
OLD=${OLD:-}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1
rows=${*:-"small 8b fp8 bamba startup"}
failed=()

run_tree() {  # tag (new|old), name, command...: run in that tree, log to $OUT/logs/<name>_<tag>.log
  local tag=$1 name=$2; shift 2
  local dir=$NEW
  [ "$tag" = old ] && dir=$OLD
  local log="$OUT/logs/${name}_$tag.log" start=$SECONDS
  (cd "$dir" && PYTHONPATH=$dir PIECEWORKS_CACHE_ROOT=/tmp/pw_cache_$tag "$@") >"$log" 2>&1
  local rc=$?
  echo "=== $name ($tag): exit $rc after $((SECONDS - start)) s"
  grep -v "^DEBUG\|^INFO\|capturing graphs" "$log" | tail -n 10
  [ "$rc" -eq 0 ] || failed+=("${name}_$tag")
}

both() {  # name, command...: old (when given) then new
  local name=$1; shift
  [ -n "$OLD" ] && run_tree old "$name" "$@" --output-json "$OUT/${name}_old.json"
  run_tree new "$name" "$@" --output-json "$OUT/${name}_new.json"
}

bench=(python3 -m pieceworks.entrypoints.cli bench latency --modes full_and_piecewise)
EIGHT_B=(--model llama-3.1-8b --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 3)

for row in $rows; do
  case $row in
    small) both llama125m "${bench[@]}" --model llama-125m --batch-size 1,8 --input-len 32 --output-len 128
           both smollm2 "${bench[@]}" --model smollm2-135m-random --batch-size 1,8 --input-len 32 --output-len 128 ;;
    8b) both llama8b "${bench[@]}" "${EIGHT_B[@]}" --batch-size 1,64 ;;
    fp8) both llama8b_fp8 "${bench[@]}" "${EIGHT_B[@]}" --quantization fp8 --batch-size 1,64 ;;
    bamba) both bamba9b "${bench[@]}" --model bamba-9b --batch-size 1 --input-len 128 --output-len 32 --num-iters-warmup 1 --num-iters 3 ;;
    startup) export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pw_pycache}
             python3 -m compileall -q -j 0 "$NEW/pieceworks" ${OLD:+"$OLD/pieceworks"} >/dev/null 2>&1 || true
             both startup_llama8b python3 -m pieceworks.entrypoints.cli bench startup --model llama-3.1-8b --batch-size 1 ;;
    *) echo "unknown row $row (known: small 8b fp8 bamba startup)"; failed+=("$row") ;;
  esac
done

latency_files=$(ls "$OUT"/*.json 2>/dev/null | grep -v "/startup_")
if [ -n "$latency_files" ]; then
  # shellcheck disable=SC2086  # the file names are words
  python3 "$NEW/benchmarks/perf_table.py" $latency_files 2>&1 | cut -c1-300 || true
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== failed: ${failed[*]} (logs in $OUT/logs)"
  exit 1
fi
echo "=== all rows ran"
