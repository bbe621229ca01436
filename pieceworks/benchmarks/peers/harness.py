"""What every peer's measurement shares: timed runs, the static loops' startup and per-step
timing, the ``measure_mode``-shaped result, and freeing the device afterwards.

Results are shaped like ``latency.measure_mode``'s (``graph_mode`` "baseline", pipeline counters all
zero, ``level`` None), so the CLI table shows them beside the modes. Latency is end to end with one
device sync at the end. The static loops time each compiled step with device events and no host
sync between the steps (``step_timing``), as their loops run and as the engine's steps run in its
steady state, and profile a few decode steps for their device-busy time (``device_busy``). The
floor counts the same bytes as ``latency.decode_bytes``. A quantized case runs its peers
unquantized (HF has no FP8 path of pieceworks' kind): each such row says so in its ``note``.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pieceworks.benchmarks.device_busy import (
    NUM_PROFILED_STEPS,
    profile_device_busy,
    with_idle_share,
)
from pieceworks.benchmarks.latency import _COUNTERS, LatencyCase, _stats
from pieceworks.platforms import current_platform


def timed_latencies(
    case: LatencyCase,
    generate: Callable[[], torch.Tensor],
    prepare: Callable[[], None] = lambda: None,
) -> tuple[list[float], torch.Tensor]:
    """Warm-ups, then ``num_iters`` end-to-end runs, each ending in one device sync.

    ``prepare`` runs before each, outside the clock (the static loop empties its cache there).
    """
    platform = current_platform()
    for _ in range(case.num_iters_warmup):
        prepare()
        generate()
    latencies, tokens = [], torch.empty(0, dtype=torch.long)
    for _ in range(case.num_iters):
        prepare()
        platform.synchronize()
        start = time.perf_counter()
        tokens = generate()
        platform.synchronize()
        latencies.append(time.perf_counter() - start)
    return latencies, tokens


def peer_result(
    mode: str,
    case: LatencyCase,
    latencies: list[float],
    step_seconds: list[float],
    tokens: torch.Tensor,
    startup: dict[str, Any],
    floor_bytes: int,
    bandwidth: float | None,
    busy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``measure_mode`` shape: ``startup`` has startup_s, load_s, compile_s, capture_s."""
    decode_ms = _stats([s * 1e3 for s in step_seconds])
    if busy is None:
        busy = {"device_busy_ms": None, "device_idle_share": None,
                "device_busy_note": "n/a: not profiled for this peer"}  # fmt: skip
    result: dict[str, Any] = {
        "mode": mode,
        "merged_modes": [],
        "status": "ok",
        "level": None,
        "graph_mode": "baseline",
        "backend": None,
        "latency_s": _stats(latencies),
        "decode_step_ms": decode_ms,
        "num_decode_steps": len(step_seconds),
        **with_idle_share(busy, decode_ms["median"]),
        **startup,
        "graph_memory_gib": None,
        "counters": dict.fromkeys(_COUNTERS, 0),
        "first_output_token_ids": tokens[0, :16].tolist() if tokens.numel() else [],
    }
    quantization = case.engine_args.get("quantization")
    if quantization:
        result["note"] = f"runs the unquantized model (quantization={quantization} is ignored)"
    if bandwidth:
        floor_ms = floor_bytes / bandwidth * 1e3
        result["floor_ms"] = floor_ms
        result["ratio_to_floor"] = decode_ms["median"] / floor_ms if step_seconds else None
    return result


def measure_static_loop(
    case: LatencyCase, decoder: Any, model: nn.Module, input_ids: torch.Tensor,
    start: float, load_seconds: float, reset: Callable[[], None],
) -> tuple[list[float], list[float], torch.Tensor, dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Startup, timed runs, per-step times and the device-busy profile of a static loop.

    Startup is loading plus one generation: ``compile_s`` is its first compiled step (Dynamo and
    Inductor), ``capture_s`` its second (where reduce-overhead records the CUDA graph; cudagraph
    trees warm up on a function's first call).
    """
    startup_steps: list[float] = []
    reset()
    decoder.generate(input_ids, case.output_len, startup_steps)
    startup_steps += [0.0, 0.0]  # output_len < 3 has fewer compiled steps
    startup = {
        "startup_s": time.perf_counter() - start,
        "load_s": load_seconds,
        "compile_s": startup_steps[0],
        "capture_s": startup_steps[1],
    }
    latencies, tokens = timed_latencies(
        case, functools.partial(decoder.generate, input_ids, case.output_len), reset
    )
    step_seconds: list[float] = []
    reset()
    decoder.generate(input_ids, case.output_len, step_seconds)
    reset()
    first, position = decoder.prefill(input_ids)
    num_steps = min(NUM_PROFILED_STEPS, case.output_len - 1)

    def run_steps() -> None:  # the tokens it returns are not a step count
        decoder.decode(first, position, num_steps)

    busy = profile_device_busy(run_steps, num_steps)
    return latencies, step_seconds, tokens, startup, busy


def free_device_memory() -> None:
    """Collect garbage and return the cached device memory."""
    gc.collect()
    current_platform().empty_cache()


def release_compiled() -> None:
    """Drop torch.compile's state (the compiled step, its CUDA graph pool), then free memory."""
    torch.compiler.reset()
    free_device_memory()
