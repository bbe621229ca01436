"""The gated delta rule's torch forms equal transformers' and each other.

Proves: ``chunk_gated_delta_rule`` and ``recurrent_gated_delta_rule`` equal transformers'
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (Qwen3.5's modeling file)
with and without an initial state, with shared query/key heads (Hv = 2 Hk) and a length that is
not a multiple of the chunk; the chunked form equals the recurrent one; a sequence cut in two,
the second part starting from the first's final state, equals it in one piece (what a chunked
prefill and decode after it rely on).
Run: pytest tests/kernels/test_torch_gated_delta_rule.py
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from pieceworks.kernels.gated_delta_rule.torch_gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
# transformers swaps in flash-linear-attention's kernels where fla is installed; the oracle is
# its torch form, which the decorator keeps as ``__wrapped__``.
THEIR_CHUNK = inspect.unwrap(modeling.torch_chunk_gated_delta_rule)
THEIR_RECURRENT = inspect.unwrap(modeling.torch_recurrent_gated_delta_rule)

BATCH, LENGTH, K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 21, 2, 4, 16, 8


def inputs(seed: int, length: int = LENGTH):
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    q, k = randn(BATCH, length, K_HEADS, K_DIM), randn(BATCH, length, K_HEADS, K_DIM)
    v = randn(BATCH, length, V_HEADS, V_DIM)
    g = -F.softplus(randn(BATCH, length, V_HEADS))  # log decay <= 0
    beta = torch.sigmoid(randn(BATCH, length, V_HEADS))
    state = randn(BATCH, V_HEADS, K_DIM, V_DIM)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("with_state", [False, True])
def test_both_forms_equal_transformers(with_state):
    q, k, v, g, beta, state = inputs(0)
    initial = state if with_state else None
    for ours, theirs, extra in [
        (chunk_gated_delta_rule, THEIR_CHUNK, {"chunk_size": 8}),
        (recurrent_gated_delta_rule, THEIR_RECURRENT, {}),
    ]:
        out, final = ours(q, k, v, g, beta, initial, **extra)
        expected, expected_final = theirs(
            q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=True, **extra,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(final, expected_final, rtol=0, atol=0)


def test_chunked_equals_recurrent():
    q, k, v, g, beta, state = inputs(1)
    chunked = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=8)
    recurrent = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    for a, b in zip(chunked, recurrent):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_sequence_continued_from_its_state_equals_it_whole():
    q, k, v, g, beta, _ = inputs(2)
    whole, whole_final = chunk_gated_delta_rule(q, k, v, g, beta)
    cut = 13
    first, state = chunk_gated_delta_rule(*(x[:, :cut] for x in (q, k, v, g, beta)))
    outputs = [first]
    for t in range(cut, LENGTH):  # then decode steps, one token each
        out_t, state = recurrent_gated_delta_rule(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)), state
        )
        outputs.append(out_t)
    torch.testing.assert_close(torch.cat(outputs, dim=1), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, whole_final, rtol=1e-4, atol=1e-5)
