"""The torch references of the kernels: the rotary embedding and ``silu_and_mul``.

Proves: the neox rotation is HF's ``rotate_half`` form and the GPT-J one rotates adjacent pairs,
each checked against a loop written out here; a partial rotary dim leaves the tail of every head
as it was; the cache is read at the given positions and cast to the heads' dtype;
``rotate_leading_heads`` rotates only the first heads; ``rotary_embedding`` and its op
(``torch.ops.pieceworks.rotary_embedding``) rotate q and k alike, and its fake gives tensors of
their shapes; ``silu_and_mul`` is ``silu(gate) * up``.
Run: pytest tests/kernels/test_torch_references.py
"""

from __future__ import annotations

import math

import pytest
import torch

from pieceworks.kernels.activation.torch_activation import silu_and_mul
from pieceworks.kernels.rope.torch_rotary import (
    apply_rotary_emb,
    rotary_embedding,
    rotary_embedding_fake,
    rotary_embedding_op,
    rotate_heads_by_cache,
    rotate_leading_heads,
)


def cos_sin_cache(max_position: int, rotary_dim: int) -> torch.Tensor:
    """vLLM's layout: cos in the first half of each row, sin in the second."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def rotate_by_loop(
    positions: list[int], heads: torch.Tensor, head_size: int, rotary_dim: int, neox: bool
) -> torch.Tensor:
    """Every pair of every head rotated one at a time, in float64."""
    num_tokens = heads.shape[0]
    x = heads.double().view(num_tokens, -1, head_size).clone()
    out = x.clone()
    half = rotary_dim // 2
    for t, position in enumerate(positions):
        for i in range(half):
            angle = position / (10000 ** (2 * i / rotary_dim))
            c, s = math.cos(angle), math.sin(angle)
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
            out[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
    return out.reshape(num_tokens, -1)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_rotation_matches_the_pairwise_loop(neox, rotary_dim):
    torch.manual_seed(0)
    head_size, num_heads = 8, 3
    positions = [5, 0, 17, 3]
    heads = torch.randn(len(positions), num_heads * head_size)
    cache = cos_sin_cache(32, rotary_dim)
    got = rotate_heads_by_cache(
        torch.tensor(positions), heads, cache, head_size, is_neox_style=neox
    )
    assert got.shape == heads.shape
    torch.testing.assert_close(
        got.double(), rotate_by_loop(positions, heads, head_size, rotary_dim, neox)
    )
    if rotary_dim < head_size:  # the tail of every head is untouched
        tail = heads.view(len(positions), num_heads, head_size)[..., rotary_dim:]
        assert torch.equal(got.view(len(positions), num_heads, head_size)[..., rotary_dim:], tail)


def test_neox_and_gptj_differ_and_position_zero_is_the_identity():
    torch.manual_seed(1)
    heads = torch.randn(2, 16)
    cache = cos_sin_cache(8, 8)
    neox = rotate_heads_by_cache(torch.tensor([3, 0]), heads, cache, 8, True)
    gptj = rotate_heads_by_cache(torch.tensor([3, 0]), heads, cache, 8, False)
    assert not torch.allclose(neox[0], gptj[0])
    torch.testing.assert_close(neox[1], heads[1])
    torch.testing.assert_close(gptj[1], heads[1])


def test_apply_rotary_emb_by_hand():
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # (T=1, H=1, R=4)
    cos = torch.tensor([[[0.5, 0.25]]])
    sin = torch.tensor([[[2.0, 3.0]]])
    # neox pairs (1, 3) and (2, 4); GPT-J pairs (1, 2) and (3, 4).
    neox = apply_rotary_emb(x, cos, sin, True)
    assert neox.tolist() == [
        [[1 * 0.5 - 3 * 2, 2 * 0.25 - 4 * 3, 3 * 0.5 + 1 * 2, 4 * 0.25 + 2 * 3]]
    ]
    gptj = apply_rotary_emb(x, cos, sin, False)
    assert gptj.tolist() == [
        [[1 * 0.5 - 2 * 2, 2 * 0.5 + 1 * 2, 3 * 0.25 - 4 * 3, 4 * 0.25 + 3 * 3]]
    ]


def test_the_cache_is_cast_to_the_heads_dtype():
    torch.manual_seed(2)
    heads = torch.randn(3, 8, dtype=torch.bfloat16)
    cache = cos_sin_cache(8, 8).double()
    got = rotate_heads_by_cache(torch.tensor([1, 2, 7]), heads, cache, 8, True)
    assert got.dtype == torch.bfloat16
    want = rotate_by_loop([1, 2, 7], heads.float(), 8, 8, True)
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("neox", [True, False])
def test_rotate_leading_heads_rotates_only_the_first_heads(neox):
    torch.manual_seed(3)
    head_size = 4
    qkv = torch.randn(2, 5 * head_size)
    cache = cos_sin_cache(8, head_size)
    positions = torch.tensor([6, 2])
    got = rotate_leading_heads(positions, qkv, cache, head_size, 3, neox)
    want_rotated = rotate_heads_by_cache(positions, qkv[:, : 3 * head_size], cache, head_size, neox)
    assert torch.equal(got[:, : 3 * head_size], want_rotated)
    assert torch.equal(got[:, 3 * head_size :], qkv[:, 3 * head_size :])


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_embedding_and_its_op_rotate_query_and_key(neox):
    torch.manual_seed(4)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the op is registered
    positions = torch.tensor([1, 4, 9], device=device)
    query, key = torch.randn(3, 4 * 8, device=device), torch.randn(3, 2 * 8, device=device)
    cache = cos_sin_cache(16, 8).to(device)
    q, k = rotary_embedding(positions, query, key, cache, 8, neox)
    assert torch.equal(q, rotate_heads_by_cache(positions, query, cache, 8, neox))
    assert torch.equal(k, rotate_heads_by_cache(positions, key, cache, 8, neox))
    op_q, op_k = rotary_embedding_op()(positions, query, key, cache, 8, neox)
    assert torch.equal(op_q, q) and torch.equal(op_k, k)
    assert rotary_embedding_op() is torch.ops.pieceworks.rotary_embedding
    meta = [t.to("meta") for t in (positions, query, key, cache)]
    meta_q, meta_k = rotary_embedding_op()(*meta, 8, neox)  # the fake gives the shapes
    assert meta_q.shape == query.shape and meta_k.shape == key.shape
    fake_q, fake_k = rotary_embedding_fake(positions, query, key, cache, 8, neox)
    assert fake_q.shape == query.shape and fake_k.shape == key.shape
    assert fake_q.dtype == query.dtype and fake_k.dtype == key.dtype


def test_silu_and_mul_is_silu_of_the_gate_times_up():
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0, 4.0, -1.0], [0.0, 2.0, -3.0, 1.0, 1.0, 2.0]])
    got = silu_and_mul(x)
    gate, up = x[:, :3], x[:, 3:]
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, gate * torch.sigmoid(gate) * up)


def test_silu_and_mul_splits_the_last_dim_of_a_batched_input():
    torch.manual_seed(5)
    x = torch.randn(2, 3, 8)
    got = silu_and_mul(x)
    assert got.shape == (2, 3, 4)
    torch.testing.assert_close(got, torch.nn.functional.silu(x[..., :4]) * x[..., 4:])
