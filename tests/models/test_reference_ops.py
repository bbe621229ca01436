"""The torch reference ops against the formulas they define, written out per token in float64.

Proves, for the Mamba2 references on a ragged batch that mixes every slot case (a continued
prefill from its slot, a fresh sequence that keeps its final state, padding of length 0, a
sequence without a cache slot), that each output row equals the formula, that exactly the slots
of real sequences with a slot are rewritten (with the last ``d_conv - 1`` inputs, history
included, and the final SSM state), that ``dt`` goes through softplus, its bias and its limits,
that heads read their group's B and C, and that bfloat16 inputs are computed in float32; and, for
paged attention, a bfloat16 batch against dense float64 attention and a cache read through a
shuffled block table.

Run: pytest tests/models/test_reference_ops.py
"""

from __future__ import annotations

import math

import pytest
import torch

from pieceworks.models.attention.ops.reference import paged_attention_reference
from pieceworks.models.mamba.ops import causal_conv1d_ref, gated_rms_norm_ref, ssm_scan_ref

CONV_DIM, D_CONV = 3, 4
NUM_HEADS, HEAD_DIM, NUM_GROUPS, D_STATE = 4, 2, 2, 3
NUM_SLOTS = 5
# Sequence 0 continues from slot 0 (fewer tokens than d_conv - 1); 1 starts fresh in slot 3;
# 2 is padding (slot 1 must stay as it is); 3 has no slot (-1): it starts from zeros and its
# state is dropped; 4 starts fresh in slot 2 with one token. Nobody owns slot 4.
SEQ_LENS = [2, 5, 0, 3, 1]
SLOTS = [0, 3, 1, -1, 2]
HAS_INITIAL = [True, False, True, True, False]
UNTOUCHED_SLOTS = (1, 4)


def _batch_tensors():
    bounds = [0]
    for length in SEQ_LENS:
        bounds.append(bounds[-1] + length)
    return (
        torch.tensor(bounds, dtype=torch.int32),
        torch.tensor(SLOTS, dtype=torch.int32),
        torch.tensor(HAS_INITIAL),
    )


def _sequences():
    start = 0
    for seq_idx, length in enumerate(SEQ_LENS):
        yield seq_idx, start, start + length
        start += length


def _silu(value: float) -> float:
    return value / (1.0 + math.exp(-value))


@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv1d_is_the_windowed_sum_and_leaves_the_last_inputs_in_each_slot(with_bias):
    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(SEQ_LENS)
    xBC = torch.randn(num_tokens, CONV_DIM, generator=gen)
    weight = torch.randn(CONV_DIM, D_CONV, generator=gen)
    bias = torch.randn(CONV_DIM, generator=gen) if with_bias else None
    conv_state = torch.randn(NUM_SLOTS, CONV_DIM, D_CONV - 1, generator=gen)
    before = conv_state.clone()
    query_start_loc, slots, has_initial = _batch_tensors()

    out = causal_conv1d_ref(xBC, weight, bias, conv_state, query_start_loc, slots, has_initial)

    x, w, s = xBC.double(), weight.double(), before.double()
    for seq_idx, start, end in _sequences():
        slot = SLOTS[seq_idx]
        from_cache = slot >= 0 and HAS_INITIAL[seq_idx]
        history = s[slot] if from_cache else torch.zeros(CONV_DIM, D_CONV - 1, dtype=torch.float64)
        window = torch.cat([history, x[start:end].t()], dim=1)  # (conv_dim, d_conv - 1 + L)
        for t in range(end - start):
            for channel in range(CONV_DIM):
                total = float((w[channel] * window[channel, t : t + D_CONV]).sum())
                total += float(bias[channel]) if bias is not None else 0.0
                assert float(out[start + t, channel]) == pytest.approx(_silu(total), abs=1e-5)
        if slot >= 0 and end > start:
            expected_state = window[:, -(D_CONV - 1) :]
            torch.testing.assert_close(conv_state[slot].double(), expected_state)
    for slot in UNTOUCHED_SLOTS:  # the padded sequence's, and nobody's
        assert torch.equal(conv_state[slot], before[slot])
    # Sequence 0 is shorter than d_conv - 1: its new state still holds one input of its history.
    assert torch.equal(conv_state[0][:, 0], before[0][:, 2])


def _scan_inputs(gen, dtype=torch.float32):
    num_tokens = sum(SEQ_LENS)
    return {
        "x": torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype),
        "dt": torch.randn(num_tokens, NUM_HEADS, generator=gen).to(dtype),
        "A": -torch.rand(NUM_HEADS, generator=gen) - 0.5,
        "B": torch.randn(num_tokens, NUM_GROUPS, D_STATE, generator=gen).to(dtype),
        "C": torch.randn(num_tokens, NUM_GROUPS, D_STATE, generator=gen).to(dtype),
    }


def _scan_formula(inputs, D, dt_bias, ssm_state, dt_limit):
    """Per token, per head: state = exp(dt A) state + dt x B^T; y = state C + D x; float64."""
    x, dt, A = inputs["x"].double(), inputs["dt"].double(), inputs["A"].double()
    B, C = inputs["B"].double(), inputs["C"].double()
    heads_per_group = NUM_HEADS // NUM_GROUPS
    y = torch.zeros(x.shape, dtype=torch.float64)
    final_states = {}
    for seq_idx, start, end in _sequences():
        slot = SLOTS[seq_idx]
        from_cache = slot >= 0 and HAS_INITIAL[seq_idx]
        state = (
            ssm_state[slot].double().clone()
            if from_cache
            else torch.zeros(NUM_HEADS, HEAD_DIM, D_STATE, dtype=torch.float64)
        )
        for t in range(start, end):
            for head in range(NUM_HEADS):
                group = head // heads_per_group
                raw = float(dt[t, head]) + (float(dt_bias[head]) if dt_bias is not None else 0.0)
                step = min(max(math.log1p(math.exp(raw)), dt_limit[0]), dt_limit[1])
                state[head] = state[head] * math.exp(step * float(A[head])) + step * torch.outer(
                    x[t, head], B[t, group]
                )
                y[t, head] = state[head] @ C[t, group]
                if D is not None:
                    y[t, head] += float(D[head]) * x[t, head]
        if slot >= 0 and end > start:
            final_states[slot] = state
    return y, final_states


@pytest.mark.parametrize(
    "with_D, with_dt_bias, dt_limit",
    [(True, True, (0.0, float("inf"))), (False, False, (0.2, 0.9))],
)
def test_ssm_scan_is_the_recurrence_per_token_and_leaves_final_states_in_slots(
    with_D, with_dt_bias, dt_limit
):
    gen = torch.Generator().manual_seed(1)
    inputs = _scan_inputs(gen)
    D = torch.randn(NUM_HEADS, generator=gen) if with_D else None
    dt_bias = torch.randn(NUM_HEADS, generator=gen) if with_dt_bias else None
    ssm_state = torch.randn(NUM_SLOTS, NUM_HEADS, HEAD_DIM, D_STATE, generator=gen)
    before = ssm_state.clone()
    query_start_loc, slots, has_initial = _batch_tensors()

    y = ssm_scan_ref(
        **inputs,
        D=D,
        dt_bias=dt_bias,
        ssm_state=ssm_state,
        query_start_loc=query_start_loc,
        state_indices=slots,
        has_initial_state=has_initial,
        dt_limit=dt_limit,
    )

    expected_y, final_states = _scan_formula(inputs, D, dt_bias, before, dt_limit)
    torch.testing.assert_close(y.double(), expected_y, atol=1e-5, rtol=1e-5)
    assert set(final_states) == {0, 2, 3}
    for slot, state in final_states.items():
        torch.testing.assert_close(ssm_state[slot].double(), state, atol=1e-5, rtol=1e-5)
    for slot in UNTOUCHED_SLOTS:
        assert torch.equal(ssm_state[slot], before[slot])


def test_ssm_scan_default_dt_limit_only_applies_softplus():
    gen = torch.Generator().manual_seed(2)
    inputs = _scan_inputs(gen)
    ssm_state = torch.randn(NUM_SLOTS, NUM_HEADS, HEAD_DIM, D_STATE, generator=gen)
    before = ssm_state.clone()
    query_start_loc, slots, has_initial = _batch_tensors()
    y = ssm_scan_ref(
        **inputs,
        D=None,
        dt_bias=None,
        ssm_state=ssm_state,
        query_start_loc=query_start_loc,
        state_indices=slots,
        has_initial_state=has_initial,
    )
    expected_y, _ = _scan_formula(inputs, None, None, before, (0.0, float("inf")))
    torch.testing.assert_close(y.double(), expected_y, atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs_are_scanned_and_convolved_in_float32():
    """Outputs keep the input dtype; the arithmetic is float32 (bfloat16 arithmetic is off by
    far more than the rounding of the result)."""
    gen = torch.Generator().manual_seed(3)
    inputs = _scan_inputs(gen, torch.bfloat16)
    ssm_state = torch.randn(NUM_SLOTS, NUM_HEADS, HEAD_DIM, D_STATE, generator=gen)
    D = torch.randn(NUM_HEADS, generator=gen).to(torch.bfloat16)
    before = ssm_state.clone()
    query_start_loc, slots, has_initial = _batch_tensors()
    y = ssm_scan_ref(
        **inputs,
        D=D,
        dt_bias=None,
        ssm_state=ssm_state.to(torch.bfloat16),
        query_start_loc=query_start_loc,
        state_indices=slots,
        has_initial_state=has_initial,
    )
    assert y.dtype == torch.bfloat16
    expected_y, _ = _scan_formula(inputs, D, None, before.to(torch.bfloat16), (0.0, float("inf")))
    torch.testing.assert_close(y.double(), expected_y, atol=2e-2, rtol=1e-2)

    xBC = torch.randn(sum(SEQ_LENS), CONV_DIM, generator=gen).to(torch.bfloat16)
    weight = torch.randn(CONV_DIM, D_CONV, generator=gen).to(torch.bfloat16)
    conv_state = torch.randn(NUM_SLOTS, CONV_DIM, D_CONV - 1, generator=gen).to(torch.bfloat16)
    out = causal_conv1d_ref(
        xBC, weight, None, conv_state.clone(), query_start_loc, slots, has_initial
    )
    reference = causal_conv1d_ref(
        xBC.float(), weight.float(), None, conv_state.float(), query_start_loc, slots, has_initial
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference.to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("n_groups", [1, 2])
def test_gated_rms_norm_normalises_each_group_of_the_gated_input(n_groups):
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(3, 8, generator=gen)
    gate = torch.randn(3, 8, generator=gen)
    weight = torch.randn(8, generator=gen)
    eps = 1e-2
    out = gated_rms_norm_ref(y, gate, weight, eps, n_groups)
    hidden = y.double() * torch.nn.functional.silu(gate.double())
    groups = hidden.view(3, n_groups, 8 // n_groups)
    rms = torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    expected = weight.double() * (groups / rms).view(3, 8)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    half = gated_rms_norm_ref(y.bfloat16(), gate.bfloat16(), weight.bfloat16(), eps, n_groups)
    assert half.dtype == torch.bfloat16


def _dense_attention(query, key, value, scale):
    """(q_len, H, D) causal attention of the last q_len positions of a (seq_len, H, D) context."""
    query_len, seq_len = query.shape[0], key.shape[0]
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    positions = torch.arange(seq_len)
    visible = positions[None, :] <= (seq_len - query_len + torch.arange(query_len))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), value)


def test_paged_attention_reads_through_a_shuffled_block_table_in_float32():
    """Two sequences (a 3-token chunk of a 7-token context, a decode of a 5-token context),
    bfloat16, GQA with 2 query heads per KV head, blocks of 3 in a shuffled order."""
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim, block_size = 8, 4, 8, 3  # more KV heads than block rows
    seq_lens, query_lens = [7, 5], [3, 1]
    block_tables = torch.tensor([[5, 0, 3, 6, 1], [2, 7, 4, 9, 9]], dtype=torch.int32)
    key_cache = torch.randn(10, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    value_cache = torch.randn(10, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).bfloat16()
    output = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    paged_attention_reference(
        query,
        key_cache,
        value_cache,
        output,
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        scale=scale,
    )
    start = 0
    for seq_idx, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        blocks = block_tables[seq_idx].long()
        key = key_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(2, dim=1)
        value = value_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(2, dim=1)
        rows = query[start : start + query_len].double()
        expected = _dense_attention(rows, key, value, scale)
        got = output[start : start + query_len]
        # float32 arithmetic: the result is the exact one rounded once to bfloat16.
        torch.testing.assert_close(got, expected.to(torch.bfloat16), atol=0, rtol=0)
        start += query_len
