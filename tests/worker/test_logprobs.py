"""``pieceworks.worker.logprobs`` on small random logits (no model).

Proves: values are float32 ``log_softmax`` of the raw logits (temperature does not change them);
rank is 1 + the number of strictly more likely tokens; each row gets its own top-k (0: none);
rows that did not ask are left out, and nothing is computed when no row asked; prompt logprobs
computed in chunks equal one pass over all rows.

Run: ``pytest tests/worker/test_logprobs.py -q``.
"""

from __future__ import annotations

import torch

from pieceworks.sampling_params import SamplingParams
from pieceworks.worker import logprobs


def test_sample_logprobs_rows_ranks_and_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 50, dtype=torch.bfloat16)
    token_ids = torch.tensor([4, 7, 9])
    params = [
        SamplingParams(logprobs=3, temperature=0.5),
        SamplingParams(),
        SamplingParams(logprobs=0),
    ]
    rows, values = logprobs.sample_logprobs(logits, params, token_ids)
    assert rows == [0, 2]
    reference = logits.float().log_softmax(dim=-1)
    first, last = values.tolist()
    assert first.token_id == 4 and abs(first.logprob - reference[0, 4].item()) < 1e-6
    assert first.rank == int((reference[0] > reference[0, 4]).sum()) + 1
    assert first.top_ids == reference[0].topk(3).indices.tolist()
    assert last.top_ids == [] and last.token_id == 9
    assert logprobs.sample_logprobs(logits, [SamplingParams()] * 3, token_ids) is None


def test_prompt_logprobs_in_chunks_equal_one_pass():
    torch.manual_seed(0)
    num_rows = logprobs.PROMPT_LOGPROBS_CHUNK + 40  # two chunks
    hidden = torch.randn(num_rows, 8)
    head = torch.randn(8, 30)
    targets = torch.randint(0, 30, (num_rows,))
    num_top = [2] * logprobs.PROMPT_LOGPROBS_CHUNK + [5] * 40  # the second chunk asks more
    values = logprobs.prompt_logprobs(hidden, lambda h: h @ head, targets, num_top).tolist()
    once = logprobs.token_logprobs(hidden @ head, targets, num_top).tolist()
    assert [v.token_id for v in values] == targets.tolist()
    for chunked, whole in zip(values, once):
        assert chunked.rank == whole.rank and chunked.top_ids == whole.top_ids
        assert abs(chunked.logprob - whole.logprob) < 1e-5


def test_every_row_asking_gets_its_values_and_a_slice_keeps_its_rows():
    logits = torch.tensor([[0.0, 1.0, 1.0, -1.0], [2.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(logprobs=2), SamplingParams(logprobs=1)]
    rows, values = logprobs.sample_logprobs(logits, params, torch.tensor([2, 3]))
    assert rows == [0, 1]
    reference = logits.log_softmax(dim=-1)
    first, second = values.tolist()
    assert first.rank == 1  # tied with token 1: only strictly more likely tokens count
    assert second.rank == 2
    assert first.logprob == reference[0, 2].item() and second.logprob == reference[1, 3].item()
    assert sorted(first.top_ids) == [1, 2] and len(second.top_ids) == 1
    assert first.top_logprobs == reference[0, first.top_ids].tolist()
    assert second.top_ids == [0] and second.top_logprobs == [reference[1, 0].item()]
    (sliced,) = values.slice(1, 2).tolist()
    assert sliced == second
    assert values.slice(0, 1).num_top == [2]


def test_a_chunk_that_asked_fewer_is_padded_with_zeros_and_cut_back():
    num_rows = logprobs.PROMPT_LOGPROBS_CHUNK + 1
    hidden = torch.eye(num_rows, 6)
    targets = torch.zeros(num_rows, dtype=torch.long)
    num_top = [1] * logprobs.PROMPT_LOGPROBS_CHUNK + [3]
    values = logprobs.prompt_logprobs(hidden, lambda h: h * 1.0, targets, num_top)
    assert values.top_ids.shape == (num_rows, 3)
    assert values.top_ids[0, 1:].tolist() == [0, 0]
    assert values.top_logprobs[0, 1:].tolist() == [0.0, 0.0]
    rows = values.tolist()
    assert len(rows[0].top_ids) == 1 and len(rows[-1].top_ids) == 3
    assert rows[0].top_ids == [0] and rows[0].rank == 1  # row 0's one-hot favours token 0
    assert logprobs._pad_columns(values.top_ids, 3) is values.top_ids
