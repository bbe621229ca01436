#!/usr/bin/env bash
# The GPU evidence run (an H200 here): install offline, resolve the platform, run the GPU and
# platform-agnostic tests with real CUDA graphs, then the benchmarks. Logs and JSON go to $OUT
# (default ./gpu_out), one file per section, written as each section finishes.
# Usage: OUT=dir bash benchmarks/gpu_suite.sh [sections...]   (default: all but 8b)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d)  # logs live outside $OUT; $OUT/logs.tgz is refreshed after each section
export PYTHONUNBUFFERED=1 PIECEWORKS_CACHE_ROOT=${PIECEWORKS_CACHE_ROOT:-/tmp/pw_cache}
sections=${*:-"install platforms tests toy attention run bench125m"}

run() {  # name, command...
  local name=$1; shift
  echo "=== $name: $*" | tee "$LOGS/$name.log"
  local start=$SECONDS
  "$@" >>"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - start)) s" | tee -a "$LOGS/$name.log"
  grep -v "^DEBUG\|^INFO\|capturing graphs" "$LOGS/$name.log" | tail -n 14 | grep -v "^===" || true
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .  # partial results survive a kill
}

for section in $sections; do
  case $section in
    install) run install python3 -m pip install -q --no-deps --no-build-isolation -e . -e examples/pieceworks-simgraph ;;
    platforms) run platforms pieceworks platforms ;;
    versions) run versions python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" ;;
    tests) run tests python3 -m pytest -m "gpu or platform_agnostic" tests -q -p no:cacheprovider ;;
    toy) run toy python3 benchmarks/toy_overhead.py --layers 32 --out "$OUT/toy_overhead.json" ;;
    attention) run attention python3 benchmarks/attention_decode.py --out "$OUT/attention_decode.json" ;;
    run) run pieceworks_run pieceworks run ;;
    bench125m) run bench125m pieceworks bench latency --model llama-125m --batch-size 8 --input-len 32 --output-len 128 --modes eager,piecewise,full_and_piecewise --output-json "$OUT/bench_llama125m.json" --plot "$OUT/bench_llama125m.png" ;;
    check8b) run check8b python3 benchmarks/compare_levels.py --model llama-3.1-8b --modes eager@float32,eager,full_and_piecewise --out "$OUT/check_llama8b.json" ;;
    check125m) run check125m python3 benchmarks/compare_levels.py --model llama-125m --out "$OUT/check_llama125m.json" ;;
    modegpu) run modegpu python3 -m pytest -m gpu tests/engine/test_engine_gpu.py tests/models/test_bamba_gpu.py -q -p no:cacheprovider ;;
    bench8b64) run bench8b64 pieceworks bench latency --model llama-3.1-8b --batch-size 64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --output-json "$OUT/bench_llama8b_b64.json" ;;
    hostoverhead) run hostoverhead python3 benchmarks/attention_host_overhead.py ;;
    bench8b) run bench8b pieceworks bench latency --model llama-3.1-8b --batch-size 1,64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes piecewise,full_and_piecewise --output-json "$OUT/bench_llama8b.json" --plot "$OUT/bench_llama8b.png" ;;
    compare8b) run compare8b pieceworks bench latency --model llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --compare --output-json "$OUT/compare_llama8b.json" ;;
    coldwarm8b) export PIECEWORKS_CACHE_ROOT=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
                run cold8b pieceworks bench latency --model llama-3.1-8b --batch-size 1 --input-len 16 --output-len 4 --num-iters-warmup 0 --num-iters 1 --modes full_and_piecewise --output-json "$OUT/cold8b.json"
                export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)  # only pieceworks' cache is warm
                run warm8b pieceworks bench latency --model llama-3.1-8b --batch-size 1 --input-len 16 --output-len 4 --num-iters-warmup 0 --num-iters 1 --modes full_and_piecewise --output-json "$OUT/warm8b.json" ;;
    benchbamba) run benchbamba pieceworks bench latency --model bamba-9b --batch-size 1,8 --input-len 128 --output-len 32 --num-iters-warmup 1 --num-iters 1 --modes eager,piecewise,full_and_piecewise --max-num-seqs 8 --output-json "$OUT/bench_bamba9b.json" --plot "$OUT/bench_bamba9b.png" ;;
    profile8b) PROF=$(mktemp -d)
               run profile8b_b1 python3 benchmarks/profile_decode.py --model llama-3.1-8b --batch-size 1 --modes piecewise,full_and_piecewise --out-dir "$PROF"
               run profile8b_b64 python3 benchmarks/profile_decode.py --model llama-3.1-8b --batch-size 64 --steps 10 --modes full_and_piecewise --out-dir "$PROF"
               tar -czf "$OUT/profile8b.tgz" -C "$PROF" . ;;
    benchfp8) run benchfp8 pieceworks bench latency --model llama-3.1-8b --quantization fp8 --batch-size 1,64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --output-json "$OUT/bench_llama8b_fp8.json" ;;
    benchfp8cublas) run benchfp8cublas env PIECEWORKS_SMALL_M_GEMV=0 pieceworks bench latency --model llama-3.1-8b --quantization fp8 --batch-size 1,64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --output-json "$OUT/bench_llama8b_fp8_cublas.json" ;;
    pdlfp8|pdlbf16) # programmatic dependent launch (PIECEWORKS_PDL: pieceworks' and Inductor's kernels)
             quant=$([ $section = pdlfp8 ] && echo "--quantization fp8" || echo "")
             for pdl in 0 1; do
               run ${section}_$pdl env PIECEWORKS_PDL=$pdl pieceworks bench latency --model llama-3.1-8b $quant --batch-size 1,64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --output-json "$OUT/bench_${section}_$pdl.json"
             done ;;
    attngraph) # decode attention, 32 layers' caches in one graph, bf16 and FP8 output, the 8B bench's shape
               for out in bf16 fp8; do
                 run attngraph_$out python3 benchmarks/attention_decode.py --batch-sizes 1 64 --context-lens 1088 --max-model-len 8192 --graph-layers 32 --launch early late $([ $out = fp8 ] && echo --fp8-output) --out "$OUT/attention_graph_$out.json"
               done ;;
    attntests) run attntests python3 -m pytest tests/models/test_attention_kernels_gpu.py tests/models/test_attention_kernels.py tests/models/test_attention_layer.py -q -p no:cacheprovider ;;
    bench8bfull) run bench8bfull pieceworks bench latency --model llama-3.1-8b --batch-size 1,64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --output-json "$OUT/bench_llama8b_full.json" ;;
    attnsplits) run attnsplits python3 benchmarks/attention_decode.py --batch-sizes 1 --context-lens 1088 --max-model-len 8192 --num-kv-splits 0 4 8 17 32 64 --out "$OUT/attention_splits.json" ;;
    fusionfp8) # FP8 8B: Inductor's own norm + quant kernels against the fused op's (enable_fusion)
               for fusion in false true; do
                 run fusionfp8_$fusion pieceworks bench latency --model llama-3.1-8b --quantization fp8 --batch-size 1,64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --compilation-config "{\"pass_config\": {\"enable_fusion\": $fusion}}" --output-json "$OUT/bench_llama8b_fp8_fusion_$fusion.json"
               done ;;
    normprobe) run normprobe python3 benchmarks/norm_kernel_probe.py --out "$OUT/norm_kernel_probe.json" ;;
    chainprobe) run chainprobe python3 benchmarks/kernel_chain_probe.py --out "$OUT/kernel_chain_probe.json" ;;
    tmaprobe) run tmaprobe python3 benchmarks/gemv_tma_probe.py --out "$OUT/gemv_tma_probe.json" ;;
    fusiontests) # the fusion on the device's torch (its joint-graph patterns differ from 2.13's);
                 # the other pass tests are CPU tests (their ops run on CPU tensors)
                 run fusiontests python3 -m pytest tests/models/test_fp8.py -q -s -p no:cacheprovider -k "residual_form or compiled_with_fusion" ;;
    tp) run tp python3 -m pytest -m gpu tests/distributed/test_tp_gpu.py -q -s -p no:cacheprovider ;;
    benchtp1|benchtp2) tp=${section#benchtp}
               run $section pieceworks bench latency --model llama-3.1-8b --tensor-parallel-size $tp --batch-size 1,64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --output-json "$OUT/bench_llama8b_tp$tp.json" ;;
    fp8tests) run fp8tests python3 -m pytest -m gpu tests/models/test_fp8_gpu.py -q -s -p no:cacheprovider ;;
    resttests) run resttests python3 -m pytest -m "gpu or platform_agnostic" tests -q -p no:cacheprovider --ignore=tests/models/test_fp8_gpu.py --ignore=tests/distributed/test_tp_gpu.py ;;
    tpdebug) # the TP=2 engine test with stack dumps of every rank if it is still running after 150 s
             (sleep 150; pkill -ABRT -f "multiprocessing.spawn"; sleep 3; pkill -ABRT -f "python3 -m pytest") &
             run tpdebug env PYTHONFAULTHANDLER=1 NCCL_DEBUG=WARN PIECEWORKS_DIST_TIMEOUT_S=120 python3 -m pytest -m gpu tests/distributed/test_tp_gpu.py -q -s -x -p no:cacheprovider -k "llama" ;;
    tpprobe) run tpprobe env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL PIECEWORKS_DIST_TIMEOUT_S=90 python3 benchmarks/tp_probe.py --configs full_and_piecewise:async,eager:sync,full_and_piecewise:sync --timeout ${PROBE_TIMEOUT:-100} --only-if-first-fails ;;
    autotune8b) # one batch size per run: compile_sizes must be capture sizes of that run
                run autotune8b_b1 pieceworks bench latency --model llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --compilation-config '{"compile_sizes": [1]}' --output-json "$OUT/bench_llama8b_autotune_b1.json"
                run autotune8b_b64 pieceworks bench latency --model llama-3.1-8b --batch-size 64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --compilation-config '{"compile_sizes": [64]}' --output-json "$OUT/bench_llama8b_autotune_b64.json" ;;
    autotunefp8) run autotunefp8_b1 pieceworks bench latency --model llama-3.1-8b --quantization fp8 --batch-size 1 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --compilation-config '{"compile_sizes": [1]}' --output-json "$OUT/bench_llama8b_fp8_autotune_b1.json" ;;
    profilebamba) PROF=$(mktemp -d)
                  run profilebamba python3 benchmarks/profile_decode.py --model bamba-9b --batch-size 1 --input-len 128 --modes full_and_piecewise --out-dir "$PROF"
                  tar -czf "$OUT/profilebamba.tgz" -C "$PROF" . ;;
    profilefp8) PROF=$(mktemp -d)
                run profilefp8 python3 benchmarks/profile_decode.py --model llama-3.1-8b --quantization fp8 --batch-size 1 --modes full_and_piecewise --out-dir "$PROF"
                run layerspansfp8 python3 benchmarks/layer_spans.py "$PROF/trace_full_and_piecewise_b1.json.gz"
                tar -czf "$OUT/profilefp8.tgz" -C "$PROF" . ;;
    residenttests) run residenttests python3 -m pytest tests/models/test_resident_gemv_gpu.py tests/models/test_resident_gemv.py -q -s -p no:cacheprovider ;;
    residentprobe) run residentprobe env PYTHONPATH=. python3 benchmarks/resident_gemv_probe.py --out "$OUT/resident_gemv_probe.json" ;;
    l2probe) run l2probe python3 benchmarks/l2_prefetch_probe.py --out "$OUT/l2_prefetch_probe.json" ;;
    gemvfp8) run gemvfp8 python3 benchmarks/gemv_decode.py --fp8 --out "$OUT/gemv_fp8.json" ;;
    gemv) run gemv python3 benchmarks/gemv_decode.py --out "$OUT/gemv_decode.json" ;;
    bench8bgemv) run bench8bgemv env PIECEWORKS_SMALL_M_GEMV=1 pieceworks bench latency --model llama-3.1-8b --batch-size 1,64 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --output-json "$OUT/bench_llama8b_gemv.json" ;;
    profilegemv) PROF=$(mktemp -d)
                 run profilegemv env PIECEWORKS_SMALL_M_GEMV=1 python3 benchmarks/profile_decode.py --model llama-3.1-8b --batch-size 1 --modes full_and_piecewise --out-dir "$PROF"
                 tar -czf "$OUT/profilegemv.tgz" -C "$PROF" . ;;
    kerneltests) run kerneltests python3 -m pytest tests/models/test_triton_rounding.py tests/models/test_attention_kernels_gpu.py tests/models/test_attention_layer.py tests/models/test_triton_gemv.py tests/models/test_gemv_rope.py tests/models/test_llama_layers.py -q -p no:cacheprovider ;;
    bench8bcublas) run bench8bcublas env PIECEWORKS_SMALL_M_GEMV=0 pieceworks bench latency --model llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 64 --num-iters-warmup 1 --num-iters 2 --modes full_and_piecewise --output-json "$OUT/bench_llama8b_cublas.json" ;;
    tpllama) run tpllama python3 -m pytest -m "gpu or platform_agnostic" tests/distributed/test_tp_gpu.py tests/distributed/test_executor.py -q -s -p no:cacheprovider -k "all_reduce or llama" ;;
    tpbamba) run tpbamba python3 -m pytest -m gpu tests/distributed/test_tp_gpu.py -q -s -p no:cacheprovider -k bamba ;;
    *) echo "unknown section $section" ;;
  esac
done
