"""The q/k head norm and rotary kernel, and the qkv op that runs it after the GEMV.

Proves that (1) ``norm_rotate_qk_heads``'s kernel equals a float64 reference that rounds where the
torch forms round (``rms_norm``: the normalised value, then its product with the weight;
``gemma_rms_norm``: once, after ``1 + weight``; the rotation once) for float32 and bfloat16, head
sizes 64, 128 and 256, GQA (4 q heads, 2 kv heads), 1, 5 and 19 tokens (two programs of 16) at
positions far from 0, q heads scaled by the q weight and k heads by the k weight, v heads
untouched, in place; (2) in float32 it equals the torch forms the model traces (its fallback and
oracle); (3) ``small_m_qk_norm_rope_linear`` is the GEMV and then that kernel where the kernels
run, and ``F.linear`` with the torch forms on CPU tensors, launching nothing.
The kernel runs in Triton's interpreter on CPU tensors where no GPU is visible (as
``test_gemv_rope.py``). Real sizes: ``test_qk_norm_rope_gpu.py``.
Run: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_qk_norm_rope.py -p no:cacheprovider
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel below is decorated

from pieceworks.kernels import triton_device  # noqa: E402
from pieceworks.kernels.gemv import triton_gemv  # noqa: E402
from pieceworks.kernels.gemv.triton_gemv_qk_norm_rope import (  # noqa: E402
    small_m_qk_norm_rope_linear,
)
from pieceworks.kernels.rope import triton_qk_norm_rope  # noqa: E402
from pieceworks.kernels.rope.triton_qk_norm_rope import (  # noqa: E402
    norm_rotate_qk_heads,
    norm_rotate_qk_heads_torch,
)
from tests.kernels.test_gemv_rope import no_launch, rope_operands  # noqa: E402
from tests.kernels.test_triton_gemv import DEVICE, TOLERANCES, operands, requires_triton  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, EPSILON = 4, 2, 1e-6


def norm_operands(num_tokens: int, head_size: int, dtype: torch.dtype, unit_offset: bool):
    """``(qkv, positions, cache, norm)``: a qkv result, a distinct position per token, the cache
    in ``dtype`` and the q and k weights (Gemma's around 0, the plain ones around 1)."""
    generator = torch.Generator().manual_seed(num_tokens * 7 + head_size)
    num_columns = (NUM_HEADS + 2 * NUM_KV_HEADS) * head_size
    qkv = 3.0 * torch.randn(num_tokens, num_columns, generator=generator)
    center = 0.0 if unit_offset else 1.0
    weights = [center + 0.3 * torch.randn(head_size, generator=generator) for _ in range(2)]
    rotary_emb, positions = rope_operands(num_tokens, head_size, dtype)
    norm = (weights[0].to(DEVICE, dtype), weights[1].to(DEVICE, dtype), EPSILON, unit_offset)
    return qkv.to(DEVICE, dtype), positions, rotary_emb.cos_sin_cache, norm


def reference(qkv, positions, cache, heads: tuple[int, int, int], norm) -> torch.Tensor:
    """In float64, rounded to qkv's dtype where the torch forms round; ``heads = (D, Hq, Hkv)``."""
    head_size, num_heads, num_kv_heads = heads
    q_weight, k_weight, epsilon, unit_offset = norm
    dtype, num_tokens = qkv.dtype, qkv.shape[0]
    rounded = lambda t: t.to(dtype).double()  # noqa: E731
    all_heads = qkv.double().view(num_tokens, -1, head_size)  # (T, H, D)
    num_normed = num_heads + num_kv_heads
    normed = all_heads[:, :num_normed]
    weight = torch.cat([q_weight.double().expand(num_heads, -1),
                        k_weight.double().expand(num_kv_heads, -1)])  # fmt: skip
    scaled = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + epsilon)
    normed = rounded(scaled * (1 + weight)) if unit_offset else rounded(rounded(scaled) * weight)
    cos, sin = cache.double()[positions].unsqueeze(1).chunk(2, dim=-1)  # (T, 1, D / 2) each
    x1, x2 = normed.chunk(2, dim=-1)
    rotated = torch.cat([rounded(x1 * cos - x2 * sin), rounded(x2 * cos + x1 * sin)], dim=-1)
    return torch.cat([rotated, all_heads[:, num_normed:]], dim=1).view(num_tokens, -1)


@requires_triton
@pytest.mark.parametrize("unit_offset", [False, True], ids=["rms_norm", "gemma"])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64_reference(dtype, head_size, unit_offset, monkeypatch):
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    for num_tokens in (1, 5, 19):
        qkv, positions, cache, norm = norm_operands(num_tokens, head_size, dtype, unit_offset)
        expected = reference(qkv, positions, cache, (head_size, NUM_HEADS, NUM_KV_HEADS), norm)
        stored = qkv.clone()
        args = (positions, stored, cache, head_size, NUM_HEADS, NUM_KV_HEADS, norm)
        output = norm_rotate_qk_heads(*args)
        assert output.data_ptr() == stored.data_ptr()  # in place
        torch.testing.assert_close(output.double(), expected, **TOLERANCES[dtype])
        v_columns = (NUM_HEADS + NUM_KV_HEADS) * head_size
        assert torch.equal(output[:, v_columns:], qkv[:, v_columns:])


@requires_triton
@pytest.mark.parametrize("unit_offset", [False, True], ids=["rms_norm", "gemma"])
def test_kernel_equals_the_torch_forms_in_float32(unit_offset, monkeypatch):
    qkv, positions, cache, norm = norm_operands(5, 64, torch.float32, unit_offset)
    args = (positions, cache, 64, NUM_HEADS, NUM_KV_HEADS, norm)
    expected = norm_rotate_qk_heads_torch(positions, qkv, *args[1:])
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    output = norm_rotate_qk_heads(positions, qkv.clone(), *args[1:])
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@requires_triton
def test_op_runs_the_gemv_then_the_kernel(monkeypatch):
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    launched: list[str] = []
    monkeypatch.setattr(triton_gemv, "launch_gemv", lambda x, w: launched.append("gemv") or x @ w.T)
    launch = triton_qk_norm_rope.launch

    def recorded_launch(*args, **options):
        launched.append("norm")
        return launch(*args, **options)

    monkeypatch.setattr(triton_qk_norm_rope, "launch", recorded_launch)
    x, weight = operands(3, (NUM_HEADS + 2 * NUM_KV_HEADS) * 64, 96, torch.float32)
    _, positions, cache, norm = norm_operands(3, 64, torch.float32, unit_offset=False)
    heads = (64, NUM_HEADS, NUM_KV_HEADS)
    output = small_m_qk_norm_rope_linear(x, weight, positions, cache, *heads, *norm)
    assert launched == ["gemv", "norm"]
    expected = norm_rotate_qk_heads_torch(positions, F.linear(x, weight), cache, *heads, norm)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_op_never_launches_on_cpu_tensors(monkeypatch):
    monkeypatch.setattr(triton_gemv, "launch_gemv", no_launch)
    monkeypatch.setattr(triton_qk_norm_rope, "launch", no_launch)
    x, weight = operands(3, (NUM_HEADS + 2 * NUM_KV_HEADS) * 32, 64, torch.float32)
    _, positions, cache, norm = norm_operands(3, 32, torch.float32, unit_offset=True)
    x, weight, positions, cache = x.cpu(), weight.cpu(), positions.cpu(), cache.cpu()
    norm = (norm[0].cpu(), norm[1].cpu(), *norm[2:])
    heads = (32, NUM_HEADS, NUM_KV_HEADS)
    output = small_m_qk_norm_rope_linear(x, weight, positions, cache, *heads, *norm)
    expected = norm_rotate_qk_heads_torch(positions, F.linear(x, weight), cache, *heads, norm)
    assert torch.equal(output, expected)
