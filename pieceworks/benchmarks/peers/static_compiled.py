"""The ``static_compiled`` peer: the decode loop a capable user writes on HF transformers.

The "torch.compile with a static cache" recipe: a ``StaticCache`` sized to ``input_len +
output_len``, an eager prefill, then ``output_len - 1`` one-token steps, each a forward plus
greedy argmax under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs where
the device has them), positions passed explicitly from a device tensor advanced in place. Its
attention reads each KV head once and its q/k/v projections run as one matmul
(``hf_attention``). It needs an attention-only Llama (HF has no static cache for Mamba layers);
the independent ``gpt_fast`` loop keeps it honest (SPEC §6: within 10 %).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pieceworks.benchmarks.latency import LatencyCase
from pieceworks.benchmarks.peers.gpt_fast_model import causal_block_mask
from pieceworks.benchmarks.peers.harness import measure_static_loop, peer_result, release_compiled
from pieceworks.benchmarks.peers.hf_attention import fuse_hf_qkv, use_gqa_attention
from pieceworks.benchmarks.peers.hf_model import (
    hf_decode_bytes,
    import_transformers,
    load_hf_baseline,
    static_cache_skip_reason,
)
from pieceworks.benchmarks.step_timing import timed_steps
from pieceworks.engine.arg_utils import resolve_hf_config


class StaticCacheDecoder:
    """The HF static-cache loop: a ``StaticCache``, eager prefill, compiled one-token decode.

    The compiled step reads and writes the cache in place (``StaticCache`` marks its tensors as
    static addresses), so "reduce-overhead" can replay one CUDA graph per step. Positions come
    from a device tensor advanced in place (no cache-length query per step). The step's output
    buffer belongs to the graph and is overwritten by the next replay: each token is cloned out.
    ``gqa=False`` keeps HF's own attention (for comparing the two); ``fuse_qkv`` (on by
    default, as the independent loop and the engine do) makes each layer's q/k/v one matmul
    (``fuse_hf_qkv``).
    """

    def __init__(
        self, model: nn.Module, max_cache_len: int, compile_backend: str | Callable = "inductor",
        gqa: bool = True, fuse_qkv: bool = True,
    ) -> None:  # fmt: skip
        transformers = import_transformers()
        self.model = model
        if fuse_qkv:
            fuse_hf_qkv(model)
        if gqa:
            use_gqa_attention(model)
            block_mask = causal_block_mask(max_cache_len, next(model.parameters()).device)
            for layer in model.model.layers:  # type: ignore[union-attr]
                layer.self_attn.decode_block_mask = block_mask
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
        # transformers 5.24 names it ``cache`` (``past_key_values`` deprecated); 5.17 does not.
        forward_args = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        backbone_args = inspect.signature(model.model.forward).parameters  # type: ignore[union-attr]
        self.pass_cache_position = "cache_position" in backbone_args
        # ``mode`` is an Inductor option; other backends (e.g. "eager" in tests) take none.
        mode = "reduce-overhead" if compile_backend == "inductor" else None
        self.decode_step = torch.compile(
            self.forward_argmax, fullgraph=True, backend=compile_backend, mode=mode
        )

    def reset(self) -> None:
        """Empty the cache in place (same tensors, so the compiled step's graph stays valid)."""
        self.cache.reset()

    def forward_argmax(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append ``token_ids`` ``(batch, T)`` at ``positions`` ``(T,)``; greedy next token."""
        kwargs: dict[str, Any] = {self.cache_arg: self.cache, "position_ids": positions[None]}
        if self.pass_cache_position:
            kwargs["cache_position"] = positions
        logits = self.model(
            input_ids=token_ids, use_cache=True, logits_to_keep=1, return_dict=False, **kwargs
        )[0]  # (batch, 1, vocab): a long prefill never materialises logits for every position
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts ``(B, T)`` into the cache (``reset()`` first): first tokens, next position."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.forward_argmax(input_ids, positions), positions[-1:] + 1

    @torch.no_grad()
    def decode(
        self, token_ids: torch.Tensor, position: torch.Tensor, num_steps: int,
        step_seconds: list[float] | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """``num_steps`` compiled steps (``position`` advanced in place); ``step_seconds`` gets
        each step's time (``step_timing.timed_steps``: no sync between steps)."""
        state = [token_ids]

        def step() -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            state[0] = self.decode_step(state[0], position).clone()  # the graph owns its output
            position.add_(1)
            return state[0]

        if step_seconds is None:
            return [step() for _ in range(num_steps)]
        return timed_steps(step, num_steps, step_seconds)

    def generate(
        self, input_ids: torch.Tensor, num_tokens: int, step_seconds: list[float] | None = None
    ) -> torch.Tensor:
        """Greedy ``(batch, num_tokens)`` (call ``reset()`` first); ``step_seconds`` times steps."""
        token_ids, position = self.prefill(input_ids)
        steps = self.decode(token_ids, position, num_tokens - 1, step_seconds)
        return torch.cat([token_ids, *steps], dim=1)


def _check_attention_only(case: LatencyCase) -> None:
    reason = static_cache_skip_reason(case, resolve_hf_config(case.model))
    if reason:
        raise ValueError(f"{case.model}: the static-cache baseline {reason}")


def measure_static_cache_compiled(
    case: LatencyCase, bandwidth: float | None = None, compile_backend: str = "inductor"
) -> dict[str, Any]:
    """Time the HF static-cache loop under torch.compile; a ``measure_mode`` result.

    ``compile_backend="eager"`` makes tests fast.
    """
    _check_attention_only(case)
    start = time.perf_counter()
    model_config, model, input_ids = load_hf_baseline(case)
    load_seconds = time.perf_counter() - start
    floor_bytes = hf_decode_bytes(model, model_config.hf_config, case)
    decoder: Any = None
    try:
        decoder = StaticCacheDecoder(model, case.input_len + case.output_len, compile_backend)
        latencies, step_seconds, tokens, startup, busy = measure_static_loop(
            case, decoder, model, input_ids, start, load_seconds, decoder.reset
        )
    finally:  # also when it raised: the compiled step, its graph pool and the weights go
        decoder = None
        del model, input_ids
        release_compiled()
    return peer_result(
        "static_compiled", case, latencies, step_seconds, tokens, startup, floor_bytes,
        bandwidth, busy,
    )  # fmt: skip
