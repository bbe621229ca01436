"""Verification of speculative proposals keeps the target's tokens and the target's distribution.

Proves, at the acceptance-function level (no model): greedy rows keep proposals while they equal
the target's argmax and then the target's token (a mismatch, or the bonus after all were
accepted), -1 after; rows with fewer proposals than the batch's widest stop at their own; a
sampled request's emitted tokens follow the target distribution exactly (chi-squared over 20000
independent verifications of one request on a vocabulary of 6: the first token, the second given
the first proposal was accepted, the bonus given both were), with a proposal that is likely and
one that is unlikely; a seeded request verifies to the same tokens whatever its neighbours, and
top-k keeps every emitted token inside the top k.

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/worker/test_rejection_sampler.py -q``
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.sampling_params import SamplingParams
from pieceworks.worker.sampler import row_param_tensor
from pieceworks.worker.spec_decode.rejection_sampler import (
    RejectionSampler,
    accept_greedy,
    rejection_sample,
    target_probs,
)
from pieceworks.worker.spec_decode.verify_batch import VerifyBatch

VOCAB = 6
NUM_TRIALS = 50_000


def batch_of(index: list[list[int]], proposals: list[list[int]]) -> VerifyBatch:
    index_tensor, proposal_tensor = torch.tensor(index), torch.tensor(proposals)
    num_proposals = (proposal_tensor >= 0).sum(dim=1)
    return VerifyBatch(index_tensor, proposal_tensor, num_proposals, (num_proposals + 1).tolist())


def test_greedy_keeps_proposals_up_to_the_first_mismatch_then_the_target_token():
    target = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])
    proposals = torch.tensor([[4, 5, 6], [4, 9, 6], [1, 5, 6], [4, 5, -1]])
    assert accept_greedy(target, proposals).tolist() == [
        [4, 5, 6, 7],  # all accepted: the bonus token follows
        [4, 5, -1, -1],  # the second differs: the target's token there
        [4, -1, -1, -1],  # none accepted: the target's first token
        [4, 5, 6, -1],  # two proposals only: the target's token after them
    ]


def test_verify_greedy_reads_each_requests_rows():
    """Two requests: 1 + 2 rows and 1 + 0 rows of logits, laid out one after the other."""
    logits = torch.full((4, VOCAB), -5.0)
    for row, token in enumerate([2, 3, 1, 5]):
        logits[row, token] = 5.0
    batch = batch_of([[0, 1, 2], [3, 3, 3]], [[2, 4], [-1, -1]])
    greedy = SamplingParams(temperature=0.0)
    tokens = RejectionSampler().verify(logits, batch, [greedy, greedy], [None, None])
    assert tokens.tolist() == [[2, 3, -1], [5, -1, -1]]


def chi_squared_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``samples`` (token ids) against ``probs`` (V,), over the tokens of mass > 0."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    kept = probs[support].double()
    expected = kept / kept.sum() * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(support.sum().item() - 1, dtype=torch.float64)
    # the chi-squared survival function: the regularized upper incomplete gamma Q(k/2, x/2)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


@pytest.mark.parametrize("proposals", [[1, 2], [4, 0]], ids=["likely", "unlikely"])
def test_rejection_sampling_emits_the_target_distribution(proposals):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=generator) * 1.5
    logits[0, 1] += 2.0
    logits[1, 2] += 2.0  # "likely": both proposals usually accepted
    probs = logits.softmax(dim=-1)  # (3, V): temperature 1, no top-k / top-p
    batch = batch_of([[0, 1, 2]] * NUM_TRIALS, [proposals] * NUM_TRIALS)
    uniforms = torch.rand(NUM_TRIALS, 2, generator=generator)
    noise = torch.empty(NUM_TRIALS, VOCAB).exponential_(generator=generator)
    tokens = rejection_sample(probs, batch, uniforms, noise)  # (N, 3)

    assert chi_squared_p(tokens[:, 0], probs[0]) > 1e-3
    first_accepted = tokens[:, 0] == proposals[0]
    assert (tokens[~first_accepted, 1] == -1).all()  # nothing after a rejection
    assert chi_squared_p(tokens[first_accepted, 1], probs[1]) > 1e-3
    both = first_accepted & (tokens[:, 1] == proposals[1])
    assert both.sum() > 100
    assert chi_squared_p(tokens[both, 2], probs[2]) > 1e-3


def test_target_probs_are_the_samplers_distribution_with_top_k():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0, 0.5]])
    params = [SamplingParams(temperature=0.5, top_k=2)]
    probs = target_probs(logits, row_param_tensor(params, torch.device("cpu")), params)
    expected = torch.zeros(VOCAB)
    expected[[0, 2]] = torch.tensor([3.0, 2.0]).div(0.5).softmax(dim=0)
    torch.testing.assert_close(probs[0], expected)


def test_a_seeded_request_verifies_alike_in_any_batch():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=generator)
    seeded = SamplingParams(temperature=1.0, seed=7, top_k=3)
    other = SamplingParams(temperature=0.8)

    def verify(rows: torch.Tensor, batch: VerifyBatch, params: list[SamplingParams]):
        generators = [
            torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params
        ]
        return RejectionSampler().verify(rows, batch, params, generators)

    alone = verify(logits[:3], batch_of([[0, 1, 2]], [[1, 2]]), [seeded])
    neighbour_first = torch.cat([logits[3:], logits[:3]])
    with_neighbour = verify(
        neighbour_first, batch_of([[0, 1, 2], [3, 4, 5]], [[0, 0], [1, 2]]), [other, seeded]
    )
    assert with_neighbour[1].tolist() == alone[0].tolist()
    for row in range(3):  # every emitted token is in its position's top 3
        token = alone[0, row].item()
        if token != -1:
            assert token in logits[row].topk(3).indices.tolist()
