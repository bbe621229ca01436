"""Latency measurement shared by `pieceworks run` and `pieceworks bench latency`.

For each mode: build an engine (timing load, compile and capture, and counting what the pipeline
did), generate ``output_len`` tokens for ``batch_size`` random prompts of ``input_len`` tokens with
greedy sampling and ``ignore_eos``, warm-ups first, then ``num_iters`` timed runs. Each engine step
ends in a host sync (with async scheduling, on the previous step's tokens), so in steady state a
step's wall time is the loop's period, device-accurate; decode steps are the uniform-decode steps
of the whole batch. The floor is the bytes a decode step must read over the
device copy bandwidth measured at the start of the run.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time
from typing import Any

import torch

from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import piecewise_backends
from pieceworks.engine.llm import LLM
from pieceworks.engine.modes import compilation_for_mode
from pieceworks.engine.sampling_params import SamplingParams
from pieceworks.logger import init_logger
from pieceworks.platforms import current_platform

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
)


@dataclasses.dataclass
class LatencyCase:
    model: str
    batch_size: int
    input_len: int
    output_len: int
    num_iters_warmup: int = 1
    num_iters: int = 3
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    compilation: dict[str, Any] = dataclasses.field(default_factory=dict)


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
    """Bytes one decode step must read: weights (but the input-embedding table) + KV read."""
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
    runner = llm.engine.runner
    kv_per_token = sum(
        2 * layer.num_kv_heads * layer.head_size * layer.kv_cache[0].element_size()
        for layer in _attention_layers(runner)
    )
    mean_context = case.input_len + case.output_len / 2
    return int(weight_bytes + case.batch_size * mean_context * kv_per_token)


def _attention_layers(runner: Any) -> list[Any]:
    from pieceworks.engine.kv_cache import attention_layers

    return attention_layers(runner.config)


def _prompts(case: LatencyCase, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(vocab_size) for _ in range(case.input_len)] for _ in range(case.batch_size)
    ]


def measure_mode(case: LatencyCase, mode: str, bandwidth: float | None = None) -> dict[str, Any]:
    """Build the engine for ``mode``, time generation, return a JSON-ready result."""
    before = compilation_counter.clone()
    start = time.perf_counter()
    compilation = compilation_for_mode(mode, case.compilation)
    llm = LLM(case.model, compilation_config=compilation, **case.engine_args)
    startup_seconds = time.perf_counter() - start
    runner = llm.engine.runner
    prompts = _prompts(case, llm.config.model_config.hf_config["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=case.output_len, ignore_eos=True)
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
    result: dict[str, Any] = {
        "mode": mode,
        "graph_mode": llm.config.compilation_config.cudagraph_mode.name,  # type: ignore[union-attr]
        "latency_s": _stats(latencies),
        "decode_step_ms": decode_ms,
        "startup_s": startup_seconds,
        "load_s": runner.load_seconds,
        "compile_s": runner.compile_seconds,
        "capture_s": runner.capture_seconds,
        "graph_memory_gib": runner.graph_memory_bytes / 1024**3,
        "compile_cache": compile_cache_state(runner.model),
        "counters": {
            name: getattr(compilation_counter, name) - getattr(before, name) for name in _COUNTERS
        },
        "first_output_token_ids": outputs[0].outputs[0].token_ids[:16] if outputs else [],
    }
    if bandwidth:
        floor_ms = decode_bytes(llm, case) / bandwidth * 1e3
        result["floor_ms"] = floor_ms
        result["ratio_to_floor"] = decode_ms["median"] / floor_ms if decode_steps else None
    llm.shutdown()
    del llm, runner
    gc.collect()
    current_platform().empty_cache()
    return result


def compile_cache_state(model: torch.nn.Module) -> dict[str, Any]:
    """Where the model's compile cache is, or why it was not used."""
    backends = piecewise_backends(model)
    dirs = sorted({b.compile_cache.directory for b in backends if b.compile_cache is not None})
    reasons = sorted({b.cache_off_reason for b in backends if b.cache_off_reason})
    if not backends:
        reasons = ["not used (no piecewise compile below level 3)"]
    return {"dirs": dirs, "off_reason": "; ".join(reasons) if not dirs else None}


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan")}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}
