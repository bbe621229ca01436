"""The norm-GEMV ops on a GPU, at the SmolLM2-135M and Llama-3.1-8B decoder shapes.

Proves that in bfloat16, compiled on CUDA, ``small_m_rms_norm_rope_linear`` (``input_layernorm ->
qkv_proj``), ``small_m_rms_norm_silu_and_mul_linear`` (``post_attention_layernorm ->
gate_up_proj``), both with the residual, and ``small_m_rms_norm_linear`` without one, (1) write
``add_rms_norm``'s residual bit for bit and (2) equal the unfused pair they replace
(``add_rms_norm`` / ``rms_norm``, then the unfused op) on at least 95 % of the values and within
one bfloat16 step of the largest value everywhere, for 1, 16 and 64 tokens (SmolLM2's small weights
take the GEMV up to 64 tokens; the 8B ones fall back past 16: the norm kernel, then cuBLAS). What
may differ: the float32 sum of squares is summed in another order than torch's, so a normalised
value near a rounding step can round the other way, and the product after it by a step. (3)
Captured in a CUDA graph (with programmatic dependent launch where the GPU has it), the replay on
new inputs gives what an eager call gives.
Run on a GPU machine: pytest -m gpu tests/kernels/test_gemv_norm_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.core.norm_quant import add_rms_norm, rms_norm
from pieceworks.kernels.gemv.triton_gemv import small_m_linear, small_m_silu_and_mul_linear
from pieceworks.kernels.gemv.triton_gemv_norm import (
    small_m_rms_norm_linear,
    small_m_rms_norm_rope_linear,
    small_m_rms_norm_silu_and_mul_linear,
)
from pieceworks.kernels.gemv.triton_gemv_rope import small_m_rope_linear
from pieceworks.models.layers.rotary_embedding import get_rope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

# (name, hidden, num_heads, num_kv_heads, head_size, intermediate)
SHAPES = [("smollm2-135m", 576, 9, 3, 64, 1536), ("llama-8b", 4096, 32, 8, 128, 14336)]
EPS, MAX_POSITION = 1e-5, 8192


def shape_operands(num_tokens: int, shape, seed: int = 0) -> dict:
    """The layer's activations, residual, norm weight and weights in bfloat16 on the GPU."""
    _, hidden, num_heads, num_kv_heads, head_size, intermediate = shape
    generator = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *size: torch.randn(*size, device="cuda", generator=generator)  # noqa: E731
    rope = get_rope(head_size, head_size, MAX_POSITION, 5e5, None, True, torch.bfloat16)
    qkv_rows = (num_heads + 2 * num_kv_heads) * head_size
    return {
        "x": randn(num_tokens, hidden).bfloat16(),
        "residual": (4 * randn(num_tokens, hidden)).bfloat16(),
        "norm_weight": (1 + 0.2 * randn(hidden)).bfloat16(),
        "qkv": (randn(qkv_rows, hidden) / hidden**0.5).bfloat16(),
        "gate_up": (randn(2 * intermediate, hidden) / hidden**0.5).bfloat16(),
        "positions": torch.randint(0, MAX_POSITION, (num_tokens,), device="cuda"),
        "cache": rope.cos_sin_cache.cuda(),
        "heads": (head_size, num_heads + num_kv_heads),
    }


def op_pairs(ops: dict) -> list:
    """``(fused op, its arguments after the norm's, the unfused op, with a residual)``."""
    rope_args = (ops["qkv"], ops["positions"], ops["cache"], *ops["heads"])
    return [
        (small_m_rms_norm_rope_linear, rope_args, small_m_rope_linear, True),
        (
            small_m_rms_norm_silu_and_mul_linear,
            (ops["gate_up"],),
            small_m_silu_and_mul_linear,
            True,
        ),
        (small_m_rms_norm_linear, (ops["qkv"], None), small_m_linear, False),
    ]


@pytest.mark.parametrize("num_tokens", [1, 16, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=[shape[0] for shape in SHAPES])
def test_each_op_equals_the_unfused_pair_at_real_sizes(shape, num_tokens):
    ops = shape_operands(num_tokens, shape)
    x, norm_weight = ops["x"], ops["norm_weight"]
    for fused, args, unfused, with_residual in op_pairs(ops):
        residual = ops["residual"] if with_residual else None
        output, residual_out = fused(x, residual, norm_weight, EPS, *args)
        if with_residual:
            normed, new_residual = add_rms_norm(x, residual, norm_weight, EPS)
            assert torch.equal(residual_out, new_residual), fused.__name__
        else:
            normed = rms_norm(x, norm_weight, EPS)
        expected = unfused(normed, *args)
        same = (output == expected).double().mean().item()
        assert same >= 0.95, f"{fused.__name__}: {same:.2%} equal"
        step = 2**-8 * expected.abs().max().item()  # one bfloat16 step of the largest value
        torch.testing.assert_close(output, expected, rtol=0, atol=step)


@pytest.mark.parametrize("shape", SHAPES, ids=[shape[0] for shape in SHAPES])
def test_graph_replay_equals_an_eager_call(shape):
    ops = shape_operands(1, shape)
    fused, args, _, _ = op_pairs(ops)[0]  # the qkv form, with the residual
    call = lambda: fused(ops["x"], ops["residual"], ops["norm_weight"], EPS, *args)  # noqa: E731
    call()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output, residual_out = call()
    new = shape_operands(1, shape, seed=1)
    for name in ("x", "residual", "positions"):
        ops[name].copy_(new[name])
    graph.replay()
    torch.cuda.synchronize()
    expected, expected_residual = call()
    assert torch.equal(output, expected) and torch.equal(residual_out, expected_residual)
