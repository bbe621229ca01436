"""The residual add + RMSNorm + FP8 quant after a GEMV, as that GEMV's epilogue and tail.

Why: in an FP8 decode graph each decoder layer runs two "add the residual, RMSNorm, quantize"
kernels right after a GEMV (``o_proj`` and ``down_proj``): on an H200 each costs its 2.2 to 2.8 µs
plus a launch gap, about 4 µs per norm all told (measured: ``docs/performance.md``, session 8),
for a few KB of work. Two ways of moving the norm into the GEMV *after* it were measured and
lost, because every program of that GEMV then pays for the row before or inside its K loop
(session 7: a prologue, 7 µs per GEMV; session 8: each K chunk normalised in the loop, gate_up
36.9 against 29.8 µs). Here the norm stays with the GEMV *before* it:

- ``ADD_RESIDUAL`` (epilogue): each program owns ``core.norm_quant.NORM_PARTIAL_WIDTH`` (64)
  output columns; it adds the residual to them (the GEMM's output rounded to the model dtype
  first, as ``add_rms_norm`` reads it), stores the new residual and the float32 sums, and the
  sum of the sums' squares over its columns: one float per token and program;
- ``NORM_TAIL``: then it takes a ticket (an atomic counter); the program that draws the last one
  knows every other program's sums are stored, adds the partial sums up to each token's
  ``1 / rms``, normalises the float32 sums, multiplies by the norm weight and quantizes them
  exactly as ``core.norm_quant`` and the fused kernel do, and resets the counter. The GEMV after
  it is unchanged: it reads the FP8 row as before.

The values equal the unfused ops' up to the order in which the squares are summed. The counter is
one int32 per device, zero between launches (the last program resets it): launches that use it
run one after another in a stream, as a decode graph runs them; two streams running such GEMVs
at once on one device would share it (not supported). The op that uses this:
``quantization/fp8_linear_norm.py``; the pass that emits it: ``core/passes/linear_norm_fold.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from pieceworks.models.layers.triton_rounding import round_to, round_to_e4m3

_counters: dict[torch.device, torch.Tensor] = {}


@dataclasses.dataclass(frozen=True)
class ResidualNorm:
    """The epilogue's operands: ``residual (T, N)`` in the model dtype, read; ``sums (T, N)`` and
    ``partials (T, num_partials(N))`` float32 scratch, written. With ``norm_weight (N,)``: the
    tail writes ``quant(rms_norm(sums), scale)`` into ``result (T, N)`` float8_e4m3fn."""

    residual: torch.Tensor
    sums: torch.Tensor
    partials: torch.Tensor
    norm_weight: torch.Tensor | None = None
    epsilon: float = 0.0
    scale: torch.Tensor | None = None
    result: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class ResidualArguments:
    """What ``_gemv_kernel`` takes for the residual epilogue and the norm tail (``x`` in the
    pointers' places where a mode is off: never read)."""

    pointers: tuple[torch.Tensor, ...]  # residual, sums, partials, norm weight, result, counter
    scale: Any
    epsilon: float
    num_partials: int
    tail: bool


def residual_arguments(residual: ResidualNorm | None, x: torch.Tensor) -> ResidualArguments:
    """The kernel arguments for ``residual`` (None: both modes off)."""
    if residual is None:
        return ResidualArguments((x,) * 6, x, 0.0, 0, False)
    tail = residual.norm_weight is not None
    if tail and (residual.result is None or residual.scale is None):
        raise ValueError("the norm tail needs result and scale with norm_weight")
    pointers = (
        residual.residual,
        residual.sums,
        residual.partials,
        residual.norm_weight if tail else x,
        residual.result if tail else x,
        norm_counter(x.device) if tail else x,
    )
    scale = residual.scale if tail else x
    return ResidualArguments(pointers, scale, residual.epsilon, residual.partials.shape[1], tail)


def norm_counter(device: torch.device) -> torch.Tensor:
    """The norm tail's ticket counter on ``device``: one int32, zero between launches."""
    counter = _counters.get(device)
    if counter is None:
        counter = _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


@triton.jit
def load_residual(
    residual_ptr, first_column, out_features, tokens, token_mask, stride, BLOCK_N: tl.constexpr
):
    """The residual under the program's columns, (BLOCK_N, BLOCK_M) float32."""
    columns = first_column + tl.arange(0, BLOCK_N)
    mask = (columns < out_features)[:, None] & token_mask[None, :]
    offsets = tokens.to(tl.int64)[None, :] * stride + columns[:, None]
    return tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def add_residual(
    acc,
    residual,
    sums_ptr,
    partials_ptr,
    first_column,
    out_features,
    tokens,
    token_mask,
    stride,
    num_partials,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``acc`` (BLOCK_N, BLOCK_M), rounded to ``ROUND_DTYPE`` as the GEMM stores it, plus the
    residual: stores the float32 sums and the program's partial sum of their squares per token,
    and returns the sums rounded to ``ROUND_DTYPE`` (the new residual)."""
    columns = first_column + tl.arange(0, BLOCK_N)
    mask = (columns < out_features)[:, None] & token_mask[None, :]
    sums = round_to(acc, ROUND_DTYPE) + residual
    offsets = tokens.to(tl.int64)[None, :] * stride + columns[:, None]
    tl.store(sums_ptr + offsets, sums, mask=mask)
    squares = tl.where(mask, sums * sums, 0.0)
    partial_ptrs = partials_ptr + tokens * num_partials + tl.program_id(0)
    tl.store(partial_ptrs, tl.sum(squares, axis=0), mask=token_mask)
    return round_to(sums, ROUND_DTYPE)


@triton.jit
def norm_tail(
    sums_ptr,
    partials_ptr,
    norm_weight_ptr,
    result_ptr,
    scale_ptr,
    counter_ptr,
    num_tokens,
    hidden_size,
    num_partials,
    epsilon,
    stride,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    fp8_max,
):
    """After the program stored its sums and partials: the last program to take a ticket
    writes ``quant(rms_norm(sums))`` for every token and resets the counter."""
    tl.debug_barrier()  # every thread's stores are issued before the ticket releases them
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        columns = tl.arange(0, BLOCK_HIDDEN)
        column_mask = columns < hidden_size
        parts = tl.arange(0, BLOCK_P)
        weight = tl.load(norm_weight_ptr + columns, mask=column_mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr)
        for token in range(0, num_tokens):
            # .cg: straight from L2, where the other programs' stores are (not this SM's L1)
            partials = tl.load(
                partials_ptr + token * num_partials + parts,
                mask=parts < num_partials,
                other=0.0,
                cache_modifier=".cg",
            )
            row = token * stride  # at most MAX_NORM_TAIL_TOKENS rows: no int64 needed
            sums = tl.load(
                sums_ptr + row + columns, mask=column_mask, other=0.0, cache_modifier=".cg"
            )
            inv_rms = tl.rsqrt(tl.sum(partials, axis=0) / hidden_size + epsilon)
            normed = round_to(sums * inv_rms, ROUND_DTYPE)
            quantized = round_to_e4m3(round_to(normed * weight, ROUND_DTYPE) / scale, fp8_max)
            tl.store(
                result_ptr + row + columns,
                quantized.to(result_ptr.dtype.element_ty),
                mask=column_mask,
            )
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # for the next launch
