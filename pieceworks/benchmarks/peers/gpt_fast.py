"""The ``gpt_fast`` peer: an independent, hand-written Llama decode loop in the style of gpt-fast.

It shares nothing with pieceworks' model code or with HF's: its own modules in plain torch and its
own static KV cache (``gpt_fast_model``). The one-token decode step (forward + greedy argmax) runs
under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs where the device has
them); the prefill runs eagerly once per generation (``GptFastDecoder``).

The weights are the same tensors as the other peers' (HF names, ``hf_model.load_hf_weights``), so
its greedy tokens must equal HF eager's and the pieceworks engine's on the same prompts. It keeps
the ``static_compiled`` baseline honest: SPEC §6 wants that within 10 % of this loop.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pieceworks.benchmarks.latency import LatencyCase, _prompts
from pieceworks.benchmarks.peers.gpt_fast_model import GptFastLlama
from pieceworks.benchmarks.peers.harness import measure_static_loop, peer_result, release_compiled
from pieceworks.benchmarks.peers.hf_model import (
    baseline_model_config,
    hf_decode_bytes,
    load_hf_weights,
)
from pieceworks.benchmarks.step_timing import timed_steps
from pieceworks.config import ModelConfig, resolve_dtype
from pieceworks.models.loading.sources import checkpoint_weights
from pieceworks.platforms import current_platform


class GptFastDecoder:
    """Eager prefill, then compiled one-token steps; greedy tokens ``(batch, num_tokens)``."""

    def __init__(self, model: GptFastLlama, compile_backend: str = "inductor") -> None:
        self.model = model
        mode = "reduce-overhead" if compile_backend == "inductor" else None
        self.decode_step = torch.compile(
            self.forward_argmax, fullgraph=True, backend=compile_backend, mode=mode
        )

    def forward_argmax(self, token_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.model(token_ids, input_pos).argmax(dim=-1, keepdim=True)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the prompts ``(B, T)`` to the cache: the first tokens ``(B, 1)`` and the next
        position ``(1,)``. No reset is needed between generations: each overwrites from position
        0, and the causal mask hides whatever lies beyond the current position."""
        prompt_len = input_ids.shape[1]
        positions = torch.arange(prompt_len, device=input_ids.device)
        return self.forward_argmax(input_ids, positions), positions[-1:] + 1

    @torch.no_grad()
    def decode(
        self, token_ids: torch.Tensor, input_pos: torch.Tensor, num_steps: int,
        step_seconds: list[float] | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """``num_steps`` compiled steps from ``token_ids`` at ``input_pos`` (advanced in place);
        ``step_seconds`` gets each step's time (``timed_steps``: no sync between the steps)."""
        state = [token_ids]

        def step() -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            state[0] = self.decode_step(state[0], input_pos).clone()  # the graph owns its output
            input_pos.add_(1)
            return state[0]

        if step_seconds is None:
            return [step() for _ in range(num_steps)]
        return timed_steps(step, num_steps, step_seconds)

    def generate(
        self, input_ids: torch.Tensor, num_tokens: int, step_seconds: list[float] | None = None
    ) -> torch.Tensor:
        """Greedy ``(batch, num_tokens)``; ``step_seconds`` times each decode step."""
        token_ids, input_pos = self.prefill(input_ids)
        steps = self.decode(token_ids, input_pos, num_tokens - 1, step_seconds)
        return torch.cat([token_ids, *steps], dim=1)


def build_gpt_fast_model(
    model_config: ModelConfig, device: torch.device, batch_size: int, max_len: int,
    attention: str = "flex", fuse_qkv: bool = True,
) -> GptFastLlama:  # fmt: skip
    """The independent loop's Llama on ``device``, with the same weights as the other peers.

    ``attention`` as ``GptFastLlama.setup_caches`` takes it; ``fuse_qkv``: one q/k/v matmul per
    layer, as gpt-fast's ``wqkv``."""
    dtype = resolve_dtype(model_config.dtype, model_config.hf_config)
    model = GptFastLlama.empty(model_config.hf_config, dtype, device)
    load_hf_weights(model, checkpoint_weights(model_config, device))
    if fuse_qkv:
        model.fuse_qkv()
    model.setup_caches(batch_size, max_len, attention)
    return model.eval().requires_grad_(False)


def measure_gpt_fast(
    case: LatencyCase, bandwidth: float | None = None, compile_backend: str = "inductor"
) -> dict[str, Any]:
    """Time the independent gpt-fast-style loop; a ``measure_mode``-shaped result."""
    start = time.perf_counter()
    device = current_platform().device()
    model_config = baseline_model_config(case)
    model = build_gpt_fast_model(
        model_config, device, case.batch_size, case.input_len + case.output_len
    )
    prompts = _prompts(case, model_config.hf_config["vocab_size"])
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    load_seconds = time.perf_counter() - start
    floor_bytes = hf_decode_bytes(model, model_config.hf_config, case)
    decoder: Any = None
    try:
        decoder = GptFastDecoder(model, compile_backend)
        latencies, step_seconds, tokens, startup, busy = measure_static_loop(
            case, decoder, model, input_ids, start, load_seconds, lambda: None
        )
    finally:
        decoder = None
        del model, input_ids
        release_compiled()
    return peer_result(
        "gpt_fast", case, latencies, step_seconds, tokens, startup, floor_bytes, bandwidth, busy
    )
