"""``RejectionSampler``: which proposals a speculative step keeps, and the token after them.

Rows are first biased by their request's ``logit_bias`` and masked by its grammar (the runner
applies the bitmask), as the sampler's are. Greedy rows keep the target model's tokens exactly:
proposals are accepted while each equals the target's argmax at its position; the target's
argmax follows (at the first mismatch, or after all of them: the bonus token). Sampled rows use
the standard speculative-sampling rule with a point-mass draft (an n-gram proposal, or a greedy
draft model's, is certain of its token: ``q = one-hot``): proposal ``x`` at a position is
accepted with probability ``p(x)`` (the target's sampling distribution there, after
temperature, top-k and top-p), and at the first rejection the token is drawn from ``p`` with
``x`` removed and renormalised; after all are accepted the bonus is drawn from ``p``. Each
emitted token is then distributed exactly as the target would sample it
(``tests/worker/test_rejection_sampler.py`` checks it with a chi-squared test). Seeded rows draw
their uniforms and their exponential race from their own generator, so a seed reproduces.

Output: ``(S, C)`` token ids, ``REJECTED_TOKEN_ID`` (-1) past each row's produced run. Runs on
the device with no host sync, outside the captured graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.output import SchedulerOutput
from pieceworks.worker.logit_bias import apply_logit_bias
from pieceworks.worker.logprobs import TokenLogprobs, sample_logprobs
from pieceworks.worker.sampler import apply_top_k_top_p, row_argmax, row_param_tensor
from pieceworks.worker.spec_decode.verify_batch import VerifyBatch


class RejectionSampler:
    """Verifies a step's proposals against its logits (see the module docstring)."""

    def verify_step(
        self,
        output: SchedulerOutput,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> tuple[torch.Tensor, tuple[list[int], TokenLogprobs] | None]:
        """A speculative step's tokens, ``(S * C,)`` row by row (what the scheduler takes), and
        the log-probabilities of every column of the rows that asked (flat rows ``i * C + j``;
        the engine keeps those of the tokens appended)."""
        batch = VerifyBatch.build(output, logits.device)
        tokens = self.verify(logits, batch, params, generators)  # (S, C)
        logprobs = None
        if any(param.logprobs is not None for param in params):
            columns = batch.num_columns
            column_params = [param for param in params for _ in range(columns)]
            column_logits = logits[batch.index.reshape(-1)]  # (S * C, V)
            column_tokens = tokens.reshape(-1).clamp(min=0)
            logprobs = sample_logprobs(column_logits, column_params, column_tokens)
        return tokens.reshape(-1), logprobs

    def verify(
        self,
        logits: torch.Tensor,
        batch: VerifyBatch,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Token ids ``(S, C)`` for ``logits`` ``(R, V)`` laid out as ``batch`` says (each
        request's ``logit_bias`` added to its rows first, as the sampler does)."""
        logits_params = [param for param, count in zip(params, batch.counts) for _ in range(count)]
        logits = apply_logit_bias(logits, logits_params)  # the same tensor unless one has a bias
        target = row_argmax(logits)[batch.index]  # (S, C): the target's greedy tokens
        greedy_tokens = accept_greedy(target, batch.proposals)
        if all(param.is_greedy for param in params):
            return greedy_tokens
        row_params = row_param_tensor(logits_params, logits.device)
        probs = target_probs(logits, row_params, params)  # (R, V)
        uniforms, noise = _draws(probs, batch, params, generators)
        random_tokens = rejection_sample(probs, batch, uniforms, noise)
        is_greedy = torch.tensor([param.is_greedy for param in params], device=logits.device)
        return torch.where(is_greedy.unsqueeze(1), greedy_tokens, random_tokens)


def accept_greedy(target: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """``target`` ``(S, C)`` up to and including the first column whose proposal differs from
    it (``proposals`` ``(S, C - 1)``, -1 never matches), -1 after."""
    matches = (proposals == target[:, :-1]).int()  # (S, C - 1)
    num_accepted = matches.cumprod(dim=1).sum(dim=1)  # (S,)
    return _keep_run(target, num_accepted)


def target_probs(
    logits: torch.Tensor, row_params: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """The distribution the sampler would draw each logits row from ``(R, V)`` float32."""
    temperature, top_k, top_p, _ = row_params
    scaled = logits.float() / temperature.unsqueeze(1)
    scaled = apply_top_k_top_p(
        scaled,
        top_k if any(param.uses_top_k for param in params) else None,
        top_p if any(param.uses_top_p for param in params) else None,
    )
    return scaled.softmax(dim=-1)


def rejection_sample(
    probs: torch.Tensor, batch: VerifyBatch, uniforms: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """Speculative sampling with point-mass proposals: ``probs`` ``(R, V)`` the target's
    distributions, ``uniforms`` ``(S, C - 1)`` in [0, 1), ``noise`` ``(S, V)`` Exp(1) draws for
    the exponential race of the token after the accepted run. Tokens ``(S, C)``."""
    proposals, index = batch.proposals, batch.index
    num_rows = index.shape[0]
    proposed = proposals.clamp(min=0)
    p_proposed = probs[index[:, :-1], proposed]  # (S, C - 1): p(x) at each position
    p_proposed = torch.where(proposals >= 0, p_proposed, 0.0)
    num_accepted = (uniforms < p_proposed).int().cumprod(dim=1).sum(dim=1)  # (S,)
    weights = probs[index.gather(1, num_accepted.unsqueeze(1)).squeeze(1)]  # (S, V) a copy
    if proposals.shape[1]:  # a rejected proposal is removed from its position's distribution
        rejected = num_accepted < batch.num_proposals  # (S,)
        column = num_accepted.clamp(max=proposals.shape[1] - 1).unsqueeze(1)
        token = proposed.gather(1, column)  # (S, 1)
        kept = torch.where(rejected.unsqueeze(1), 0.0, weights.gather(1, token))
        weights.scatter_(1, token, kept)
    recovered = weights.div_(noise).argmax(dim=-1)  # (S,): drawn from weights / sum(weights)
    padded = torch.cat([proposals, proposals.new_full((num_rows, 1), -1)], dim=1)  # (S, C)
    column = torch.arange(index.shape[1], device=index.device).unsqueeze(0)
    tokens = torch.where(column == num_accepted.unsqueeze(1), recovered.unsqueeze(1), padded)
    return _keep_run(tokens, num_accepted)


def _keep_run(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """``tokens`` ``(S, C)`` with every column after ``num_accepted`` set to -1."""
    column = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    return torch.where(column <= num_accepted.unsqueeze(1), tokens, -1)


def _draws(
    probs: torch.Tensor,
    batch: VerifyBatch,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms ``(S, C - 1)`` and Exp(1) noise ``(S, V)``: a seeded sampled row from its own
    generator (uniforms first), every other row from the global one."""
    num_rows, vocab_size = batch.index.shape[0], probs.shape[1]
    num_proposal_columns = batch.num_columns - 1
    uniforms = torch.rand(num_rows, num_proposal_columns, device=probs.device)
    noise = torch.empty(num_rows, vocab_size, device=probs.device).exponential_()
    for row, (param, generator) in enumerate(zip(params, generators)):
        if generator is None or param.is_greedy:
            continue
        uniforms[row] = torch.rand(num_proposal_columns, device=probs.device, generator=generator)
        noise[row] = torch.empty(vocab_size, device=probs.device).exponential_(generator=generator)
    return uniforms, noise.clamp_(min=torch.finfo(noise.dtype).tiny)
