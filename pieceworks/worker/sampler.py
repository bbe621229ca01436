"""``Sampler``: one token per row from the last-position logits, with no host sync.

Runs after the model forward, outside any captured graph. Per step it builds the rows' temperature,
top-k and top-p as one tensor (a single host-to-device copy), masks with one sort, and samples by
the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` picks index ``i`` with probability
``probs[i]``, in float32. Rows with a ``seed`` draw ``q`` from their own ``torch.Generator`` (see
``make_generator``), so a seeded request gets the same tokens in any batch. A request's
``logit_bias`` is added to its row first (``worker/logit_bias.py``). Greedy rows take the
argmax of the raw logits in their own dtype (``row_argmax``: two Triton launches on GPUs, else
torch); an all-greedy batch runs nothing else. The result stays on the logits'
device; the runner copies it to the host without waiting (``SampledTokens``). Which rows to
sample is the runner's business (``ScheduledRequest.produces_token``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pieceworks.kernels.sampling import triton_argmax
from pieceworks.sampling_params import SamplingParams
from pieceworks.worker.logit_bias import apply_logit_bias

# Columns per chunk of the two-stage argmax: the max of every chunk in parallel, then the argmax
# of the chunk maxima. One reduction over a 128k vocabulary row ran as a single slow reduction
# (28 us per step on the H200 at batch 1, ``docs/performance.md``).
ARGMAX_CHUNK = 1024


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for a seeded request (create once, at admission), else None."""
    if params.seed is None or params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


class Sampler:
    """Samples a batch of rows with mixed greedy / random parameters in one vectorised pass."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        row_params: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return token ids ``(S,)`` int64 on ``logits.device`` for ``logits`` ``(S, V)``.

        ``row_params`` is ``row_param_tensor(params, device)`` made once for several calls with
        the same rows (the steps of a multi-step decode run: one host-to-device copy, not one per
        step); without it a batch that samples at random makes its own."""
        if logits.dim() != 2 or not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(
                f"logits {tuple(logits.shape)} need one SamplingParams and one generator per row; "
                f"got {len(params)} and {len(generators)}"
            )
        logits = apply_logit_bias(logits, params)  # the same tensor unless a row has a bias
        greedy_token_ids = row_argmax(logits)  # (S,); the logits' own dtype orders as float32
        if all(param.is_greedy for param in params):
            return greedy_token_ids
        if row_params is None:
            row_params = row_param_tensor(params, logits.device)  # (4, S)
        temperature, top_k, top_p, is_greedy = row_params
        logits = logits.float() / temperature.unsqueeze(1)
        logits = apply_top_k_top_p(
            logits,
            top_k if any(param.uses_top_k for param in params) else None,
            top_p if any(param.uses_top_p for param in params) else None,
        )
        probs = logits.softmax(dim=-1)  # (S, V)
        noise = _exponential_noise(probs, params, generators)
        random_token_ids = probs.div_(noise).argmax(dim=-1)
        return torch.where(is_greedy.bool(), greedy_token_ids, random_token_ids)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``(S, V)`` rows, ties to the first index as torch's: the
    Triton kernel pair where the platform runs pieceworks' kernels (``triton_argmax.py``), else
    ``chunked_argmax``."""
    if triton_argmax.uses_kernel(logits):
        return triton_argmax.launch_row_argmax(logits)
    return chunked_argmax(logits)


def chunked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` in torch, as the max of each ``ARGMAX_CHUNK`` columns and then
    the argmax of those maxima."""
    num_rows, vocab_size = logits.shape
    if vocab_size <= 2 * ARGMAX_CHUNK:
        return logits.argmax(dim=-1)
    padding = -vocab_size % ARGMAX_CHUNK
    if padding:  # -inf never wins unless the whole row is -inf, and then column 0 does anyway
        logits = F.pad(logits, (0, padding), value=float("-inf"))
    chunk_max, index_in_chunk = logits.view(num_rows, -1, ARGMAX_CHUNK).max(dim=-1)  # (S, C)
    chunk = chunk_max.argmax(dim=-1, keepdim=True)  # (S, 1): the first chunk holding the max
    return (chunk * ARGMAX_CHUNK + index_in_chunk.gather(1, chunk)).squeeze(1)


def row_param_tensor(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    """Rows' (temperature, top_k, top_p, is_greedy) as one ``(4, S)`` float32 tensor, one copy.

    Greedy rows get temperature 1 (their sampled value is discarded; this avoids dividing by 0);
    disabled top-k becomes 0, which ``apply_top_k_top_p`` reads as "keep all".
    """
    rows = [
        (
            1.0 if param.is_greedy else param.temperature,
            float(max(param.top_k, 0)),
            param.top_p,
            float(param.is_greedy),
        )
        for param in params
    ]
    # float32 holds integers exactly up to 2**24, far above any vocabulary size.
    return torch.tensor(rows, dtype=torch.float32).t().contiguous().to(device, non_blocking=True)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus to -inf (one ascending sort).

    ``top_k`` ``(S,)``: 0 keeps all, ties with the k-th value are kept. ``top_p`` ``(S,)``: keeps
    the smallest set of most likely tokens whose probability reaches ``top_p`` (always >= 1 token).
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # (S, V)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size).long()
        kth_value = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))  # (S, 1)
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        cumulative = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # ascending
        top_p_mask = cumulative <= (1.0 - top_p).unsqueeze(1)
        top_p_mask[:, -1] = False  # the most likely token always survives
        logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _exponential_noise(
    probs: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """``q ~ Exp(1)`` shaped like ``probs``; seeded random rows from their own generator.

    Greedy rows draw nothing from their generator, so a seeded stream advances once per sampled
    token and only then.
    """
    random_rows = [row for row, param in enumerate(params) if not param.is_greedy]
    if any(generators[row] is None for row in random_rows):
        noise = torch.empty_like(probs).exponential_()
    else:
        noise = torch.ones_like(probs)  # greedy rows' values are discarded; keep them finite
    vocab_size = probs.shape[-1]
    for row in random_rows:
        generator = generators[row]
        if generator is not None:
            # A fresh (V,) draw per row: the values depend only on this generator's state.
            row_noise = torch.empty(vocab_size, device=probs.device, dtype=probs.dtype)
            noise[row] = row_noise.exponential_(generator=generator)
    # Exp(1) can round to 0; 0/0 would be NaN and argmax would pick a masked token.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
