"""``apply_logit_bias``: OpenAI's ``logit_bias`` added to a batch's logits before sampling.

The sampler calls it first, so greedy rows take the argmax of the biased logits and random rows
sample from them. Only the rows of requests with ``SamplingParams.logit_bias`` change: their
(row, token) entries are gathered on the host into three small tensors and added with one
``index_put_``; a batch where no request set it runs nothing and returns the logits as they are.
The sum goes into a copy, so the log-probabilities the runner computes from the logits
afterwards stay the model's raw ones (``worker/logprobs.py``). A captured decode tail picks the
argmax on the device without this step, so the runner does not use one for a batch holding a
biased request (``ModelRunner._uses_decode_tail``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pieceworks.sampling_params import SamplingParams


def has_logit_bias(params: Sequence[SamplingParams]) -> bool:
    return any(param.logit_bias for param in params)


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` ``(S, V)`` with each row's bias added (a new tensor), or ``logits`` itself
    when no row has one."""
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, param in enumerate(params):
        for token_id, bias in (param.logit_bias or {}).items():
            rows.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    if not rows:
        return logits
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device))
    values = torch.tensor(biases, dtype=logits.dtype, device=device)
    return logits.index_put(index, values, accumulate=True)
