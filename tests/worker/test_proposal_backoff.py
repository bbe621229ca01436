"""``ProposalBackoff`` decides when a request is proposed for: after a try that gave nothing
beyond the target's own token (no proposal, or all rejected) it skips 1, 2, 4, ... steps up to
its cap; a try with an accepted proposal resets it; a step that is not eligible still counts
down; ``wants_to_propose`` says whether the next step tries.

Run: pytest tests/worker/test_proposal_backoff.py -q
"""

from __future__ import annotations

from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.request import Request
from pieceworks.worker.spec_decode.backoff import ProposalBackoff


def make_request() -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=500))


def tries(backoff: ProposalBackoff, request: Request, steps: int, found: bool) -> list[int]:
    """Step ``steps`` times, each producing one token (nothing accepted); the steps that tried."""
    tried = []
    for step in range(steps):
        if backoff.should_propose(request, eligible=True):
            tried.append(step)
            backoff.proposed(request, [7, 7] if found else [])
        request.output_token_ids.append(5)
    return tried


def test_failed_tries_double_the_steps_skipped_up_to_the_cap():
    backoff, request = ProposalBackoff(max_skipped_steps=4), make_request()
    # Nothing found: fails at once; waits 1, 2, 4, 4, ... steps between tries.
    assert tries(backoff, request, 20, found=False) == [0, 2, 5, 10, 15]
    backoff, request = ProposalBackoff(max_skipped_steps=4), make_request()
    # Proposals all rejected (one token a step): judged at the start of the next step's call,
    # before it decides, so the same waits.
    assert tries(backoff, request, 20, found=True) == [0, 2, 5, 10, 15]


def test_an_accepted_proposal_resets_the_backoff():
    backoff, request = ProposalBackoff(), make_request()
    assert tries(backoff, request, 4, found=False) == [0, 2]
    assert backoff.should_propose(request, eligible=True) is False  # skipping (2 of 2)
    request.output_token_ids.append(5)
    assert backoff.should_propose(request, eligible=True)
    backoff.proposed(request, [7, 7])
    request.output_token_ids += [7, 7, 5]  # two accepted, then the target's token
    assert backoff.should_propose(request, eligible=True)  # judged a success: no skip
    assert backoff.wants_to_propose(request)


def test_steps_not_eligible_count_down_and_wants_to_propose_follows():
    backoff, request = ProposalBackoff(), make_request()
    assert backoff.wants_to_propose(request)  # never seen: tries at once
    assert backoff.should_propose(request, eligible=True)
    backoff.proposed(request, [])  # nothing found: skip 1 step
    assert not backoff.wants_to_propose(request)
    assert backoff.should_propose(request, eligible=False) is False  # counted down anyway
    assert backoff.wants_to_propose(request)
    assert backoff.should_propose(request, eligible=False) is False  # not eligible: no try
    backoff.release("r")
    assert backoff.wants_to_propose(request)
