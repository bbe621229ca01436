"""Log-probabilities of sampled and prompt tokens: computed on the device, read on the host.

``sample_logprobs`` runs after the sampler for the rows whose request asked for ``logprobs``;
``step_prompt_logprobs`` (which rows of a step to score) and ``prompt_logprobs`` (their values) give
the prefill positions of requests that asked for ``prompt_logprobs``. Both return ``TokenLogprobs``:
device tensors that stay untouched until the engine reads the step's tokens, so asking costs no
extra host sync (the read happens with the step's own). Values are the model's raw
log-probabilities: ``log_softmax`` of the logits in float32, before temperature, top-k and top-p
(vLLM's default ``raw_logprobs``). Rank is vLLM's: 1 plus the number of tokens whose log-probability
is strictly higher.

Nothing here runs when no request asks, so the greedy path without logprobs is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.output import ScheduledRequest
from pieceworks.scheduler.request import TokenLogprob

# Rows of a prompt's logits turned into log-probabilities at once: bounds the float32 temporary
# (rows x vocabulary) when a long prompt asks for prompt_logprobs.
PROMPT_LOGPROBS_CHUNK = 256


@dataclasses.dataclass
class TokenLogprobs:
    """Rows of log-probabilities on the device; ``tolist`` reads them (a sync)."""

    token_ids: torch.Tensor  # (R,) int64: the chosen (sampled or prompt) token of each row
    logprobs: torch.Tensor  # (R,) float32
    ranks: torch.Tensor  # (R,) int64
    top_ids: torch.Tensor  # (R, K) int64
    top_logprobs: torch.Tensor  # (R, K) float32
    num_top: list[int]  # per row: how many of the K columns its request asked for

    def slice(self, start: int, end: int) -> TokenLogprobs:
        """Rows ``start`` to ``end`` (views: no copy)."""
        return TokenLogprobs(
            self.token_ids[start:end],
            self.logprobs[start:end],
            self.ranks[start:end],
            self.top_ids[start:end],
            self.top_logprobs[start:end],
            self.num_top[start:end],
        )

    def tolist(self) -> list[TokenLogprob]:
        rows = zip(
            self.token_ids.tolist(),
            self.logprobs.tolist(),
            self.ranks.tolist(),
            self.top_ids.tolist(),
            self.top_logprobs.tolist(),
            self.num_top,
        )
        return [
            TokenLogprob(token, logprob, rank, top_ids[:k], top_logprobs[:k])
            for token, logprob, rank, top_ids, top_logprobs, k in rows
        ]


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> TokenLogprobs:
    """Log-probabilities of ``token_ids`` ``(R,)`` under ``logits`` ``(R, V)``, with each row's
    top ``num_top[row]``."""
    logprobs = logits.float().log_softmax(dim=-1)  # (R, V)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # (R, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(max(num_top, default=0), dim=-1)  # (R, K)
    return TokenLogprobs(token_ids, chosen.squeeze(1), ranks, top_ids, top_logprobs, num_top)


def sample_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: torch.Tensor
) -> tuple[list[int], TokenLogprobs] | None:
    """For the rows whose request asked for ``logprobs``: (their row numbers, their logprobs);
    None (and no work) when no row asked."""
    rows = [row for row, param in enumerate(params) if param.logprobs is not None]
    if not rows:
        return None
    num_top = [params[row].logprobs or 0 for row in rows]
    if len(rows) == len(params):
        return rows, token_logprobs(logits, token_ids, num_top)
    index = torch.tensor(rows, device=logits.device)
    return rows, token_logprobs(logits[index], token_ids[index], num_top)


def prompt_logprobs(
    hidden_rows: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    target_ids: torch.Tensor,
    num_top: list[int],
) -> TokenLogprobs:
    """Prompt log-probabilities for ``hidden_rows`` ``(R, hidden)``: row ``i`` scores
    ``target_ids[i]``, the prompt token after it; logits are computed in chunks of
    ``PROMPT_LOGPROBS_CHUNK`` rows so the vocabulary-wide temporaries stay small."""
    parts = []
    for start in range(0, hidden_rows.shape[0], PROMPT_LOGPROBS_CHUNK):
        end = start + PROMPT_LOGPROBS_CHUNK
        logits = compute_logits(hidden_rows[start:end])  # (chunk, V)
        parts.append(token_logprobs(logits, target_ids[start:end], num_top[start:end]))
    k = max(num_top, default=0)
    return TokenLogprobs(
        torch.cat([p.token_ids for p in parts]),
        torch.cat([p.logprobs for p in parts]),
        torch.cat([p.ranks for p in parts]),
        torch.cat([_pad_columns(p.top_ids, k) for p in parts]),
        torch.cat([_pad_columns(p.top_logprobs, k) for p in parts]),
        num_top,
    )


def _pad_columns(values: torch.Tensor, num_columns: int) -> torch.Tensor:
    """``values`` ``(R, k)`` widened to ``num_columns`` with zeros (a chunk asked for fewer)."""
    if values.shape[1] == num_columns:
        return values
    return torch.nn.functional.pad(values, (0, num_columns - values.shape[1]))


def step_prompt_logprobs(
    scheduled_requests: Sequence[ScheduledRequest],
    hidden_states: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, tuple[int, TokenLogprobs]] | None:
    """Prompt log-probabilities of a step's prefill rows whose request asked: request id ->
    (first prompt position scored, rows). Every rank computes the logits of the same rows
    (the LM head gathers across ranks); only a rank holding the prompt (rank 0) scores them."""
    rows: list[int] = []
    targets: list[int] = []
    num_top: list[int] = []
    spans: dict[str, tuple[int, int, int]] = {}  # id -> (first position, first row, rows)
    offset = 0
    for item in scheduled_requests:
        start, request = offset, item.request
        offset += item.num_new_tokens
        k = request.sampling_params.prompt_logprobs
        if k is None or item.is_decode:
            continue
        prompt, computed = request.prompt_token_ids, item.num_computed_tokens
        # Row i of the chunk (position computed + i) scores prompt token computed + i + 1;
        # rows past the prompt (its last position, resumed generated tokens) score nothing.
        num_scored = max(min(item.num_new_tokens, len(prompt) - 1 - computed), 0)
        if num_scored:
            spans[request.request_id] = (computed + 1, len(rows), num_scored)
        scored = prompt[computed + 1 : computed + 1 + num_scored]
        targets.extend(scored + [0] * (item.num_new_tokens - num_scored))
        rows.extend(range(start, start + item.num_new_tokens))
        num_top.extend([k] * item.num_new_tokens)
    if not rows:
        return None
    index = torch.tensor(rows, device=hidden_states.device)
    target_ids = torch.tensor(targets, device=hidden_states.device)
    values = prompt_logprobs(hidden_states[index], compute_logits, target_ids, num_top)
    return {
        request_id: (first, values.slice(row, row + count))
        for request_id, (first, row, count) in spans.items()
    }
