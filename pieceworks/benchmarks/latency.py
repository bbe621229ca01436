"""Latency measurement shared by `pieceworks run` and `pieceworks bench latency`.

For each mode: build an engine (timing load, compile and capture, and counting what the pipeline
did), generate ``output_len`` tokens for ``batch_size`` prompts of ``input_len`` tokens with
greedy sampling and ``ignore_eos``, warm-ups first, then ``num_iters`` timed runs; once per prompt
kind (``benchmarks/prompts.py``: random, repeating, a text to copy) on the same engine, a row
each, with its output tokens per second (batch x output_len / median latency) and, under
speculative decoding, the acceptance of that kind's runs alone. Each engine step
ends in a host sync (with async scheduling, on the previous step's tokens), so in steady state a
step's wall time is the loop's period, device-accurate; decode steps are the uniform-decode steps
of the whole batch; their min, median and max are reported. The floor is the bytes a decode step
must move (weights, KV read, a recurrent layer's state read and written back) over the device
copy bandwidth measured at the start of the run. After the timed runs a few decode steps run
under the profiler for the device-busy time per step and the share of the (unprofiled median)
step the device sat idle (``device_busy``; "n/a" on the CPU), and with
``LatencyCase.kernel_breakdown`` the per-kernel budget of those steps (``kernel_breakdown``).

Each row states what it measured: the effective compile level, graph mode and backend after the
platform's adjustments. A mode or baseline that raises becomes a row with ``status`` "failed" and
the error (``failed_result``), so one failure never costs the rest of a run.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from pieceworks.benchmarks.device_busy import engine_device_busy, with_idle_share
from pieceworks.benchmarks.mode_plan import ModePlan
from pieceworks.benchmarks.modes import MODES
from pieceworks.benchmarks.prompts import latency_prompts
from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import piecewise_backends
from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.engine.llm import LLM
from pieceworks.logger import init_logger
from pieceworks.platforms import current_platform
from pieceworks.sampling_params import SamplingParams

logger = init_logger(__name__)

_COUNTERS = (
    "num_piecewise_graphs_seen",
    "num_piecewise_capturable_graphs_seen",
    "num_backend_compilations",
    "num_inductor_compiles",
    "num_eager_compiles",
    "num_cudagraph_captured",
    "num_compiled_artifacts_loaded",
    "num_compiled_artifacts_saved",
    "num_dynamo_traces",
    "num_traced_graphs_loaded",
)


@dataclasses.dataclass
class LatencyCase:
    model: str
    batch_size: int
    input_len: int
    output_len: int
    num_iters_warmup: int = 2
    num_iters: int = 5
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    compilation: dict[str, Any] = dataclasses.field(default_factory=dict)
    kernel_breakdown: bool = False  # the per-kernel budget from the device-busy profile
    prompt_kind: str = "random"  # benchmarks/prompts.py


def measure_copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median."""
    platform = current_platform()
    source = torch.empty(num_bytes // 4, dtype=torch.float32, device=platform.device())
    source.uniform_()
    destination = torch.empty_like(source)
    samples = []
    for _ in range(repeats + 2):
        platform.synchronize()
        start = time.perf_counter()
        destination.copy_(source)
        platform.synchronize()
        samples.append(2 * source.numel() * 4 / (time.perf_counter() - start))
    del source, destination
    return statistics.median(samples[2:])


def decode_bytes(llm: LLM, case: LatencyCase) -> int:
    """Bytes one decode step must move: weights (but the input-embedding table), each sequence's
    KV read (the mean context, or a sliding-window layer's window where that is shorter) and its
    recurrent state read and written back (``recurrent_state_bytes``)."""
    model = llm.engine.runner.model
    embedding = next(
        (m for name, m in model.named_modules() if name.endswith("embed_tokens")), None
    )
    params = {id(p): p for p in model.parameters()}
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    lm_head = getattr(model, "lm_head", None)
    tied = lm_head is not None and embedding is not None and lm_head.weight is embedding.weight
    if embedding is not None and not tied:
        weight_bytes -= embedding.weight.numel() * embedding.weight.element_size()
    mean_context = case.input_len + case.output_len / 2
    kv_bytes = sum(  # a sliding-window layer reads at most its window
        2 * layer.num_kv_heads * layer.head_size * layer.kv_cache[0].element_size()
        * min(mean_context, layer.sliding_window or mean_context)
        for layer in _attention_layers(llm.engine.runner)
    )  # fmt: skip
    per_sequence = kv_bytes + recurrent_state_bytes(llm.engine.runner)
    return int(weight_bytes + case.batch_size * per_sequence)


def _attention_layers(runner: Any) -> list[Any]:
    from pieceworks.worker.kv_cache import attention_layers

    return attention_layers(runner.config)


def recurrent_state_bytes(runner: Any) -> int:
    """Bytes of one sequence's recurrent state that a decode step reads and writes back: each
    Mamba2 or Gated DeltaNet layer's conv window and its SSM or delta-rule state (one state slot,
    in the dtypes the state cache keeps them), counted twice; 0 without such layers."""
    from pieceworks.worker.mamba_cache import mamba_layers

    slot_bytes = 0
    for layer in mamba_layers(runner.config):
        assert layer.mamba_cache is not None  # bound by the runner before the first step
        conv_state, ssm_state = layer.mamba_cache
        slot_bytes += conv_state[0].nbytes + ssm_state[0].nbytes
    return 2 * slot_bytes


def _prompts(case: LatencyCase, vocab_size: int) -> list[list[int]]:
    """The case's prompts (its ``prompt_kind``), the same for every engine and peer of a run."""
    tokenizer = None
    if case.prompt_kind == "copy":
        from pieceworks.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(case.model, case.engine_args.get("tokenizer"))
    return latency_prompts(case.prompt_kind, case.batch_size, case.input_len, vocab_size, tokenizer)


def with_output_rate(result: dict[str, Any], case: LatencyCase) -> dict[str, Any]:
    """``result`` with its prompt kind and output tokens per second (batch x output_len over
    the median latency of one generation of the batch; ``ignore_eos`` makes that count exact)."""
    median = result.get("latency_s", {}).get("median")
    rate = case.batch_size * case.output_len / median if median else None
    return {**result, "prompt_kind": case.prompt_kind, "output_tokens_per_s": rate}


def resolve_effective(
    case: LatencyCase, compilation: dict[str, Any]
) -> tuple[int, str, str | None]:
    """(level, graph mode name, backend) the engine runs for ``compilation``: after the engine
    arguments (``enforce_eager``) and the platform's adjustments (no static graphs on the CPU)."""
    config = build_engine_config(case.model, compilation, **case.engine_args).compilation_config
    assert config.cudagraph_mode is not None  # resolved in __post_init__
    return int(config.level), config.cudagraph_mode.name, config.backend


def measure_mode(
    case: LatencyCase,
    plan: ModePlan | str,
    bandwidth: float | None = None,
    prompt_kinds: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Build the engine for ``plan`` (or a mode name) once and time generation on each of
    ``prompt_kinds`` (default: the case's); a JSON-ready result per kind, in that order.

    A kind that raises becomes a failed row and the next kind runs on the same engine. The
    counters (compiles, captures) are the engine's, the same in each of its rows.
    """
    if isinstance(plan, str):
        plan = ModePlan(plan, {**case.compilation, **_mode_fields(plan)})
    before = compilation_counter.clone()
    start = time.perf_counter()
    llm = LLM(case.model, compilation_config=plan.compilation, **case.engine_args)
    startup_seconds = time.perf_counter() - start
    results = []
    try:
        for kind in prompt_kinds or [case.prompt_kind]:
            kind_case = dataclasses.replace(case, prompt_kind=kind)
            try:
                result = _measure_engine(llm, kind_case, plan, startup_seconds, bandwidth)
            except Exception as error:  # noqa: BLE001 (reported in its row; the next kind runs)
                result = failed_result(
                    plan.name, error, level=plan.level, graph_mode=plan.graph_mode
                )
            results.append(with_output_rate(result, kind_case))
    finally:  # also when a step raised: the graphs and the KV cache go before the next row
        llm.shutdown()
        del llm
        free_device_memory()
    counters = {
        name: getattr(compilation_counter, name) - getattr(before, name) for name in _COUNTERS
    }
    return [{**result, "counters": counters} for result in results]


def free_device_memory() -> None:
    """Collect garbage and return cached device memory, between rows of a run."""
    gc.collect()
    current_platform().empty_cache()


def _measure_engine(
    llm: LLM, case: LatencyCase, plan: ModePlan, startup_seconds: float, bandwidth: float | None
) -> dict[str, Any]:
    """Warm-ups, timed generations, the device-busy profile and the floor of a built engine."""
    runner = llm.engine.runner
    compilation = llm.config.compilation_config
    prompts = _prompts(case, llm.config.model_config.hf_config["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=case.output_len, ignore_eos=True)
    spec_before = dataclasses.replace(llm.engine.scheduler.spec_decoding_stats)
    for _ in range(case.num_iters_warmup):
        llm.generate(prompts, params)
    latencies, decode_steps, outputs = [], [], None
    for _ in range(case.num_iters):
        llm.engine.step_seconds.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        latencies.append(time.perf_counter() - start)
        # Decode steps of the whole batch: with chunked prefill, early and late steps decode
        # only part of it, and would make the median look faster than the batch really is.
        decode_steps += [
            seconds
            for uniform, num_requests, seconds in llm.engine.step_seconds
            if uniform and num_requests == case.batch_size
        ]
    decode_ms = _stats([s * 1e3 for s in decode_steps])
    busy = engine_device_busy(llm, prompts, params, breakdown=case.kernel_breakdown)
    busy = with_idle_share(busy, decode_ms["median"])
    result: dict[str, Any] = {
        "mode": plan.name,
        "merged_modes": list(plan.merged),
        "status": "ok",
        "level": int(compilation.level),
        "graph_mode": compilation.cudagraph_mode.name,  # type: ignore[union-attr]
        "backend": compilation.backend if compilation.level else None,
        # Decode steps per host round trip (``--num-scheduler-steps``; 1: one step per call).
        "num_scheduler_steps": llm.config.scheduler_config.num_scheduler_steps,
        "latency_s": _stats(latencies),
        "decode_step_ms": decode_ms,
        "num_decode_steps": len(decode_steps),
        **busy,
        "startup_s": startup_seconds,
        "load_s": runner.load_seconds,
        "compile_s": runner.profiler.compile_seconds if compilation.level else None,
        "capture_s": runner.graphs.warmup_seconds
        + runner.graphs.capture_seconds,  # warm-ups, then captures
        "graph_memory_gib": runner.graphs.graph_memory_bytes / 1024**3,
        "compile_cache": compile_cache_state(runner.model),
        "epilogue_fusions": epilogue_fusions(runner.model),
        "kernels_chosen": runner.kernels.describe(),  # this engine's choices
        "first_output_token_ids": outputs[0].outputs[0].token_ids[:16] if outputs else [],
    }
    if llm.config.speculative_config is not None:  # this kind's warm-ups and timed runs
        result["speculative"] = {
            "method": llm.config.speculative_config.method,
            "num_speculative_tokens": llm.config.speculative_config.num_speculative_tokens,
            **_stats_since(spec_before, llm.engine.scheduler.spec_decoding_stats).as_dict(),
        }
    if bandwidth:
        floor_ms = decode_bytes(llm, case) / bandwidth * 1e3
        result["floor_ms"] = floor_ms
        result["ratio_to_floor"] = decode_ms["median"] / floor_ms if decode_steps else None
    return result


def _stats_since(before: Any, after: Any) -> Any:
    """The speculative-decoding totals of ``after`` less those of ``before``."""
    return dataclasses.replace(
        after,
        **{
            field.name: getattr(after, field.name) - getattr(before, field.name)
            for field in dataclasses.fields(after)
        },
    )


def _mode_fields(name: str) -> dict[str, Any]:
    level, graph_mode = MODES[name]
    return {"level": level, "cudagraph_mode": graph_mode}


def failed_result(name: str, error: BaseException, **fields: Any) -> dict[str, Any]:
    """The row of a mode or baseline that raised: its name, status and the error, no numbers."""
    logger.warning("%s failed: %s: %s", name, type(error).__name__, error, exc_info=error)
    return {
        "mode": name,
        "status": "failed",
        "error": f"{type(error).__name__}: {error}".strip(),
        **fields,
    }


def compile_cache_state(model: torch.nn.Module) -> dict[str, Any]:
    """Where the model's compile cache is, or why it was not used."""
    backends = piecewise_backends(model)
    dirs = sorted({b.compile_cache.directory for b in backends if b.compile_cache is not None})
    reasons = sorted({b.cache_off_reason for b in backends if b.cache_off_reason})
    if not backends:
        reasons = ["not used (no piecewise compile below level 3)"]
    return {"dirs": dirs, "off_reason": "; ".join(reasons) if not dirs else None}


def epilogue_fusions(model: torch.nn.Module) -> dict[str, int]:
    """The epilogue fusions the compile passes made in ``model``, by kind, summed over its
    compiled modules (empty below level 3 and on a warm start, which loads the fused graph)."""
    counts: dict[str, int] = {}
    for backend in piecewise_backends(model):
        for kind, count in backend.num_fusions.items():
            counts[kind] = counts.get(kind, 0) + count
    return counts


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan")}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run_environment(model: str, engine_args: dict[str, Any], commit: str | None) -> dict[str, Any]:
    """What a table row needs beside its numbers: dtype, device, versions, commit, date (UTC)."""
    import datetime
    import importlib.metadata
    import subprocess
    from pathlib import Path

    from pieceworks.config import resolve_dtype
    from pieceworks.engine.arg_utils import resolve_hf_config

    versions: dict[str, str | None] = {"torch": str(torch.__version__)}
    for package in ("triton", "transformers", "pieceworks"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    if commit is None:
        source = Path(__file__).resolve().parents[2]
        try:
            commit = subprocess.run(
                ["git", "-C", str(source), "describe", "--always", "--dirty", "--abbrev=10"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            commit = "unknown"
    platform = current_platform()
    dtype = resolve_dtype(engine_args.get("dtype", "auto"), resolve_hf_config(model))
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": engine_args.get("quantization"),
        "platform": platform.name,
        "device": platform.device_name(),
        "versions": versions,
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
