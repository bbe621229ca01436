"""Rotary position embedding (RoPE) with a precomputed cos/sin cache, and ``get_rope``.

Owns the inverse-frequency schedules that HF transformers implements in ``modeling_rope_utils``
(``default``, ``linear`` and ``llama3``), computed with the same float32 arithmetic so that logits
match HF bit for bit in float32. The cache is built once (on the CPU, then moved) and never written
in ``forward``: the compiled graph only gathers rows by position. After a model is built on the
``meta`` device and materialised with ``to_empty``, the loader calls ``init_buffers()`` to rebuild
it. Tokens are flattened: queries are ``(num_tokens, num_heads * head_size)``. ``forward(positions,
q, k)`` is the op ``pieceworks::rotary_embedding`` where the chooser gives ``rotary`` its kernel
(the qkv GEMV's rotary epilogue: the rope fusion pass, ``core/passes/gemv_fusion.py``, folds the
op into the GEMV before it) and the rotary is neox style on every dim, else plain ATen; the
choice is made once, when the model is built (``choose_kernels``, called by the loader with the
engine's chooser), so eager and compiled calls run the same form.
The rotation itself is ``rotate_heads_by_cache`` (``kernels/rope/torch_rotary.py``), a function
of the cache alone, so that ops which receive the cache rather than the module (the qkv GEMV's
fallback, ``kernels/gemv/triton_gemv_rope.py``) rotate with the same arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pieceworks.kernels.chooser import KernelChooser
from pieceworks.kernels.rope.torch_rotary import (
    rotary_embedding_op,
    rotate_heads_by_cache,
    rotate_leading_heads,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    """``1 / base ** (2i / rotary_dim)``, exactly as HF computes it."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling (HF ``_compute_llama3_parameters``), step for step."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def compute_inv_freq(
    base: float, rotary_dim: int, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Inverse frequencies ``(rotary_dim // 2,)`` in float32 for the given scaling, on the CPU."""
    rope_type = _rope_type(rope_scaling)
    scaling = rope_scaling or {}
    with torch.device("cpu"):
        inv_freq = _default_inv_freq(base, rotary_dim)
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _rope_type(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


class RotaryEmbedding(nn.Module):
    """RoPE on the first ``rotary_dim`` dims of every head; the rest pass through unchanged.

    ``cos_sin_cache`` is ``(max_position, rotary_dim)``: cos in the first half of each row, sin in
    the second (vLLM's layout), stored in the model dtype.
    """

    cos_sin_cache: torch.Tensor  # (max_position, rotary_dim)

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool,
        rope_scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(
                f"rotary_dim={rotary_dim} must be even and at most head_size={head_size}"
            )
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        self.is_neox_style = is_neox_style
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        _rope_type(self.rope_scaling)  # reject an unsupported type at construction
        cache = self._compute_cos_sin_cache(dtype).to(torch.get_default_device())
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        # an out-of-tree platform's rotary(positions, q, k, cos_sin_cache, head_size, neox)
        self.kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self.uses_op = False  # the torch form until the engine's chooser says otherwise

    def choose_kernels(self, kernels: KernelChooser) -> None:
        """Take this layer's form from the engine's chooser (once, when the model is built)."""
        self.kernel = kernels.choose("rotary").impl.fn
        # The kernel is the qkv GEMV's epilogue, which rotates every dim neox style: a partial
        # rotary (Bamba) stays plain ATen, which Inductor fuses with its neighbours.
        self.uses_op = kernels.uses_op_form("rotary") and self.is_full_neox
        if self.uses_op:  # registered before Dynamo traces the first call, which uses the handle
            self.op = rotary_embedding_op()

    def _compute_cos_sin_cache(self, dtype: torch.dtype) -> torch.Tensor:
        """Build the cache on the CPU in float32 (HF's arithmetic), then cast to ``dtype``."""
        inv_freq = compute_inv_freq(self.base, self.rotary_dim, self.rope_scaling)
        positions = torch.arange(self.max_position, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # (P, R // 2)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)  # (P, R)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Refill ``cos_sin_cache`` in place (after ``to_empty`` left it uninitialised)."""
        cache = self._compute_cos_sin_cache(self.cos_sin_cache.dtype)
        self.cos_sin_cache.copy_(cache)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions (T,)``, ``query (T, Hq * D)``, ``key (T, Hkv * D)`` -> rotated q, k."""
        args = (self.cos_sin_cache, self.head_size, self.is_neox_style)
        if self.kernel is not None:
            return self.kernel(positions, query, key, *args)
        if self.uses_op:
            query, key = self.op(positions, query, key, *args)
            return query, key
        return self.rotate_heads(positions, query), self.rotate_heads(positions, key)

    def rotate_heads(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Every head of ``heads (T, H * D)`` rotated, as one new ``(T, H * D)`` tensor.

        Models whose q and k sit side by side in the qkv projection rotate them here in one go:
        compiled, that is one kernel per layer instead of one for q and one for k, and on a
        decode step each launch costs more than its bytes.
        """
        return rotate_heads_by_cache(
            positions, heads, self.cos_sin_cache, self.head_size, self.is_neox_style
        )

    def rotate_leading_heads(
        self, positions: torch.Tensor, qkv: torch.Tensor, num_rotary_heads: int
    ) -> torch.Tensor:
        """``qkv (T, H * D)`` with its first ``num_rotary_heads`` heads (q and k) rotated by
        ``rotate_heads`` and the others (v) as they are, as one new ``(T, H * D)`` tensor."""
        return rotate_leading_heads(
            positions,
            qkv,
            self.cos_sin_cache,
            self.head_size,
            num_rotary_heads,
            self.is_neox_style,
        )

    @property
    def is_full_neox(self) -> bool:
        """Whether every dim of a head is rotated, neox style (what the qkv GEMV fuses)."""
        return self.is_neox_style and self.rotary_dim == self.head_size

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, base={self.base}, "
            f"is_neox_style={self.is_neox_style}, rope_scaling={self.rope_scaling}"
        )


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox_style: bool = True,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """vLLM's factory: a ``RotaryEmbedding`` for the given schedule (no process-wide cache).

    Build one per model and share it between layers: the cache is ``max_position * rotary_dim``.
    """
    return RotaryEmbedding(
        head_size,
        rotary_dim,
        max_position,
        base,
        is_neox_style,
        rope_scaling,
        dtype or torch.get_default_dtype(),
    )


def get_rope_parameters(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """``(rope_theta, rope_scaling or None, partial_rotary_factor)`` from a config.json dict.

    Reads both the classic keys (``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``) and
    transformers 5's ``rope_parameters``, which nests all three.
    """
    params = {**(hf_config.get("rope_scaling") or {}), **(hf_config.get("rope_parameters") or {})}
    base = params.pop("rope_theta", hf_config.get("rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return float(base), (params if rope_type != "default" else None), float(partial)
