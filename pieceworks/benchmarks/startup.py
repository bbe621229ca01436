"""``pieceworks bench startup``: an engine's time from construction to its first decode step, cold
and warm, split into phases (after ``vllm bench startup``).

Each run is a fresh process (``python -m pieceworks.benchmarks.startup``, ``main`` below), so
nothing an earlier run compiled or imported is in memory. Caches live under one temporary
directory: the cold run starts with pieceworks' compile cache (``CompilationConfig.cache_dir``,
which also holds Triton's kernel binaries: ``core/cache/triton_cache.py``) and Inductor's
(``TORCHINDUCTOR_CACHE_DIR``) empty; the warm run reuses pieceworks' cache and, as SPEC §6 defines
a warm start, gets an empty Inductor cache again, so what it loads comes from pieceworks' cache
alone (``reuse_inductor_cache`` keeps Inductor's as well). The phases, in the order start-up
runs them:

    config_s           resolve the engine's configuration (``build_engine_config``: the model's
                       config, the platform, the compilation settings)
    weight_load_s      build the model and load its weights
    dynamo_trace_s     Dynamo tracing ``forward`` (first call until the graph reaches the backend);
                       0 on a warm start that loaded the stored graph instead
    graph_load_s       a warm start: read and check the stored traced graph (``warm_start.py``)
                       instead of tracing; 0 when Dynamo traced
    compile_or_load_s  split the graph, compile or load every piece, wrap the pieces (a warm start:
                       load every piece of the stored graph, wrap them)
    kernel_compile_s   pieceworks' own Triton kernels compiled ahead, in parallel: a dry forward of
                       every warm-up shape queues them, and this waits for the pool
                       (``kernels/precompile.py``); 0 where they compile at first launch
    profile_run_s      the rest of the first forward (the profiling run that sizes the KV cache)
    kv_cache_s         allocating and zeroing the KV cache once it is sized
    kernel_warmup_s    the uncaptured warm-up of every capture shape (kernels compile here)
    capture_s          recording the static graphs
    tokenizer_s        loading the tokenizer (0 for a preset, which has none)
    other_s            the rest of engine construction (the runner's buffers and sampler, the
                       placeholder cache of the profiling run, the scheduler, synchronisations)
    first_step_s       one request of ``input_len`` tokens per batch row: prefill, one decode step

``engine_s`` is construction alone and ``total_s`` construction plus the first step. Each row
also counts the entries the run added to Triton's cache directory (``triton_cache_entries_added``):
one per kernel Triton compiled, so a warm start that adds any has compiled kernels again, and
records whether torch's modules had compiled bytecode (``python_bytecode``): a ``.pyc`` beside the
source or under ``sys.pycache_prefix``. Without one, as where ``PYTHONDONTWRITEBYTECODE`` is set
over an installation that never compiled its sources, every process compiles the source of every
module it imports (seconds, seen in ``config`` and ``compile_or_load``, which import Dynamo and
Inductor), and the table says so under its rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pieceworks import envs

ENGINE_PHASES = (
    "config_s",
    "weight_load_s",
    "dynamo_trace_s",
    "graph_load_s",
    "compile_or_load_s",
    "kernel_compile_s",
    "profile_run_s",
    "kv_cache_s",
    "kernel_warmup_s",
    "capture_s",
    "tokenizer_s",
)
PHASES = (*ENGINE_PHASES, "other_s", "first_step_s")
COUNTERS = (
    "num_dynamo_traces",
    "num_traced_graphs_loaded",
    "num_inductor_compiles",
    "num_compiled_artifacts_loaded",
    "num_compiled_artifacts_saved",
    "num_cudagraph_captured",
)


def engine_phases(llm: Any, engine_seconds: float) -> dict[str, float]:
    """The phases of an engine built in ``engine_seconds``, from what ``llm`` and its runner
    recorded."""
    from pieceworks.core.trace_once import trace_once_compilers

    runner = llm.engine.runner
    compilers = trace_once_compilers(runner.model)
    trace = sum(compiler.trace_seconds for compiler in compilers)
    graph_load = sum(compiler.graph_load_seconds for compiler in compilers)
    compile_or_load = sum(compiler.compile_seconds for compiler in compilers)
    phases = {
        "config_s": llm.config_seconds,
        "weight_load_s": runner.load_seconds,
        "dynamo_trace_s": trace,
        "graph_load_s": graph_load,
        "compile_or_load_s": compile_or_load,
        "kernel_compile_s": runner.profiler.kernel_compile_seconds,
        "profile_run_s": max(
            runner.profiler.compile_seconds - trace - graph_load - compile_or_load, 0.0
        ),
        "kv_cache_s": runner.profiler.kv_cache_seconds,
        "kernel_warmup_s": runner.graphs.warmup_seconds,
        "capture_s": runner.graphs.capture_seconds,
        "tokenizer_s": llm.tokenizer_seconds,
    }
    phases["other_s"] = max(engine_seconds - sum(phases.values()), 0.0)
    return phases


def torch_bytecode_cached() -> bool:
    """Whether torch's Python modules have compiled bytecode to import (checked on one module
    that start-up imports, without importing it)."""
    import torch

    source = os.path.join(os.path.dirname(torch.__file__), "_inductor", "compile_fx.py")
    return os.path.exists(importlib.util.cache_from_source(source))


def measure_startup(
    model: str,
    batch_size: int,
    input_len: int,
    engine_args: dict[str, Any],
    compilation: dict[str, Any],
) -> dict[str, Any]:
    """Build the engine, run one step of ``batch_size`` prompts, and time each phase."""
    from pieceworks.core.counters import compilation_counter
    from pieceworks.engine.llm import LLM
    from pieceworks.sampling_params import SamplingParams

    python_bytecode = torch_bytecode_cached()
    before = compilation_counter.clone()
    start = time.perf_counter()
    llm = LLM(model, compilation_config=compilation, **engine_args)
    engine_seconds = time.perf_counter() - start
    prompts = [list(range(1, input_len + 1)) for _ in range(batch_size)]
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # prefill + 1 decode
    start = time.perf_counter()
    llm.generate(prompts, greedy)
    first_step = time.perf_counter() - start
    phases = {**engine_phases(llm, engine_seconds), "first_step_s": first_step}
    runner = llm.engine.runner
    counters = {
        name: getattr(compilation_counter, name) - getattr(before, name) for name in COUNTERS
    }
    llm.shutdown()
    return {
        "status": "ok",
        **phases,
        "engine_s": engine_seconds,
        "total_s": engine_seconds + first_step,
        "graph_memory_gib": runner.graphs.graph_memory_bytes / 1024**3,
        "graph_memory_estimate_gib": runner.graphs.graph_memory_estimate_bytes / 1024**3,
        "counters": counters,
        "python_bytecode": python_bytecode,
    }


def run_fresh_process(
    spec: dict[str, Any], environment: dict[str, str], out: Path, timeout_s: float
) -> dict[str, Any]:
    """``measure_startup(**spec)`` in a new Python process with ``environment``; its result."""
    command = [sys.executable, "-m", "pieceworks.benchmarks.startup"]
    command += ["--spec", json.dumps(spec), "--out", str(out)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=environment, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"no result within {timeout_s:.0f} s"}
    process_seconds = time.perf_counter() - start
    if done.returncode != 0 or not out.exists():
        return {"status": "failed", "error": f"the run exited with status {done.returncode}"}
    return {**json.loads(out.read_text()), "process_s": process_seconds}


def run_startup(
    model: str,
    batch_size: int,
    input_len: int,
    engine_args: dict[str, Any],
    compilation: dict[str, Any],
    reuse_inductor_cache: bool = False,
    timeout_s: float = 1800.0,
) -> list[dict[str, Any]]:
    """The cold row, then the warm row, each from a fresh process (see the module docstring)."""
    from pieceworks.core.cache.triton_cache import TRITON_CACHE_SUBDIR

    rows = []
    with tempfile.TemporaryDirectory(prefix="pieceworks-startup-") as work_dir:
        root = Path(work_dir)
        spec = {
            "model": model,
            "batch_size": batch_size,
            "input_len": input_len,
            "engine_args": engine_args,
            "compilation": {**compilation, "cache_dir": str(root / "pieceworks")},
        }
        environment = {
            k: v for k, v in envs.environment().items() if k != "PIECEWORKS_DISABLE_COMPILE_CACHE"
        }
        triton_dir = root / "pieceworks" / TRITON_CACHE_SUBDIR
        for run in ("cold", "warm"):
            compiler_caches = "cold" if reuse_inductor_cache else run
            environment["TORCHINDUCTOR_CACHE_DIR"] = str(root / f"inductor-{compiler_caches}")
            # Triton's binaries live under pieceworks' cache (``core/cache/triton_cache.py``): kept
            # with it for the warm run, empty for the cold one.
            environment.pop("TRITON_CACHE_DIR", None)
            before = triton_cache_entries(triton_dir)
            result = run_fresh_process(spec, environment, root / f"{run}.json", timeout_s)
            added = triton_cache_entries(triton_dir) - before
            rows.append({"run": run, **result, "triton_cache_entries_added": added})
    return rows


def triton_cache_entries(directory: Path) -> int:
    """How many entries Triton's cache directory holds: one directory per compiled kernel (and
    one per helper module Triton's driver builds), so a warm start that adds any has compiled
    kernels again."""
    if not directory.is_dir():
        return 0
    return sum(1 for entry in directory.iterdir() if entry.is_dir())


def format_startup_table(rows: list[dict[str, Any]]) -> str:
    """One line per run: each phase, construction, total, and what was traced, compiled, loaded."""
    names = [phase.removesuffix("_s") for phase in PHASES]
    header = ["run", *names, "engine", "total", "traces", "graph_loads", "compiles", "loads"]
    header += ["captures", "triton"]
    lines = [" | ".join(header)]
    for row in rows:
        if row.get("status") != "ok":
            lines.append(f"{row['run']} | FAILED: {row.get('error')}")
            continue
        counters = row["counters"]
        cells = [row["run"], *(f"{row[phase]:.2f}" for phase in PHASES)]
        cells += [f"{row['engine_s']:.2f}", f"{row['total_s']:.2f}"]
        cells += [
            str(counters[name]) for name in COUNTERS if name != "num_compiled_artifacts_saved"
        ]
        cells.append(str(row.get("triton_cache_entries_added", "-")))
        lines.append(" | ".join(cells))
    lines.append("(seconds; traces, graph_loads, compiles, loads, captures: Dynamo traces, traced")
    lines.append(" graphs loaded instead, Inductor compiles, artifacts loaded from the compile")
    lines.append(" cache, graphs captured; triton: entries the run added to Triton's cache, one")
    lines.append(" per kernel compiled)")
    without_bytecode = [
        row["run"] for row in rows if row.get("status") == "ok" and not row["python_bytecode"]
    ]
    if without_bytecode:
        lines.append(
            f"warning: the {' and '.join(without_bytecode)} run found no compiled bytecode for"
            " torch's modules, so it compiled their Python source on import (seconds in config"
            " and compile_or_load). Compile them once, e.g. `python -m compileall <site-packages>`,"
            " or point PYTHONPYCACHEPREFIX at a writable directory and unset"
            " PYTHONDONTWRITEBYTECODE."
        )
    return "\n".join(lines)


def main() -> None:
    """One start-up measurement (the fresh process ``run_fresh_process`` starts)."""
    parser = argparse.ArgumentParser(description="one start-up measurement; JSON to --out")
    parser.add_argument("--spec", required=True, help="measure_startup's arguments as JSON")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = measure_startup(**json.loads(args.spec))
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
