"""The ``hf_eager`` peer: HF ``model.generate(...)``, greedy, eager, HF's default dynamic KV cache.

What a user runs without any compilation, on the same device, dtype, weights and prompts as the
engine (``hf_model``). Its decode step is timed by a logits processor (``StepClock``) stamping the
time each token is chosen, so one interval is one whole decode step (token selection, input
preparation, forward). EOS never stops it (``ignore_eos``, as the bench runs). Any model HF builds
runs here, hybrids included.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch import nn

from pieceworks.benchmarks.latency import LatencyCase
from pieceworks.benchmarks.peers.harness import free_device_memory, peer_result, timed_latencies
from pieceworks.benchmarks.peers.hf_model import (
    hf_decode_bytes,
    import_transformers,
    load_hf_baseline,
)
from pieceworks.platforms import current_platform


class StepClock:
    """An HF logits processor that stamps (after a device sync) when each token is chosen."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        current_platform().synchronize()
        self.stamps.append(time.perf_counter())
        return scores

    def step_seconds(self) -> list[float]:
        """One interval per decode step: from one token's choice to the next one's."""
        return [later - earlier for earlier, later in zip(self.stamps, self.stamps[1:])]


def hf_generate(
    model: nn.Module, input_ids: torch.Tensor, num_tokens: int, clock: StepClock | None = None
) -> torch.Tensor:
    """Greedy ``model.generate`` of exactly ``num_tokens`` tokens: ``(batch, num_tokens)``."""
    processors = import_transformers().LogitsProcessorList([] if clock is None else [clock])
    output = model.generate(  # type: ignore[operator]
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        logits_processor=processors,
    )
    return output[:, input_ids.shape[1] :]


def measure_hf_eager(case: LatencyCase, bandwidth: float | None = None) -> dict[str, Any]:
    """Time HF ``generate`` (greedy, eager) for ``case``; a ``measure_mode``-shaped result."""
    start = time.perf_counter()
    model_config, model, input_ids = load_hf_baseline(case)
    load_seconds = time.perf_counter() - start
    latencies, tokens = timed_latencies(
        case, functools.partial(hf_generate, model, input_ids, case.output_len)
    )
    clock = StepClock()
    hf_generate(model, input_ids, case.output_len, clock)
    floor_bytes = hf_decode_bytes(model, model_config.hf_config, case)
    del model, input_ids
    free_device_memory()
    startup = {"startup_s": load_seconds, "load_s": load_seconds, "compile_s": None,
               "capture_s": None}  # fmt: skip
    return peer_result(
        "hf_eager", case, latencies, clock.step_seconds(), tokens, startup, floor_bytes, bandwidth
    )
