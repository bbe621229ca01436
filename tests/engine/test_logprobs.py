"""``pieceworks.engine.logprobs`` on small random logits (no model).

Proves: values are float32 ``log_softmax`` of the raw logits (temperature does not change them);
rank is 1 + the number of strictly more likely tokens; each row gets its own top-k (0: none);
rows that did not ask are left out, and nothing is computed when no row asked; prompt logprobs
computed in chunks equal one pass over all rows.

Run: ``pytest tests/engine/test_logprobs.py -q``.
"""

from __future__ import annotations

import torch

from pieceworks.engine import logprobs
from pieceworks.engine.sampling_params import SamplingParams


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
