"""The scheduler's side of speculative decoding: which proposals a step verifies, and what the
verified tokens do to a request.

A decoding request may carry proposals (``Request.spec_token_ids``, set by the engine's proposer
before the step). ``proposals_to_verify`` says how many fit: within the token budget and short of
``max_tokens`` (verifying ``s`` proposals can produce ``s + 1`` tokens). The scheduler then
schedules ``1 + s`` tokens and allocates their KV slots (the lookahead slots) like any other
tokens, advancing ``num_computed_tokens`` by all of them. ``apply_verified_tokens`` takes the
tokens the runner produced (the accepted proposals, then the target's own token) and moves
``num_computed_tokens`` back past the rejected proposals, whose KV slots the next step simply
overwrites. ``SpecDecodingStats`` counts proposals and acceptances for the engine's stats.

Nothing here knows how proposals are made (``pieceworks/worker/spec_decode/``) or verified.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pieceworks.scheduler.block_manager import BlockManager
from pieceworks.scheduler.output import ScheduledRequest, SchedulerOutput
from pieceworks.scheduler.request import Request, RequestStatus, check_stop


@dataclasses.dataclass
class SpecDecodingStats:
    """Running totals over every verify: requests verified with at least one proposal, proposals,
    proposals accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals over proposals (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verified request: accepted proposals plus the target's own token
        (1 before any verify: a plain decode)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict[str, float]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


def proposals_to_verify(
    request: Request, token_budget: int, block_manager: BlockManager
) -> list[int]:
    """The leading proposals of ``request`` that this step can verify: none unless it decodes
    (one uncomputed token); at most ``token_budget - 1`` (its own token comes first) and at most
    ``max_tokens`` less the tokens it has and one (the target's token after the last accepted
    proposal); none when their KV slots would need a preemption (a guess never evicts anyone)."""
    proposals = request.spec_token_ids
    if not proposals or request.num_uncomputed_tokens != 1:
        return []
    num_left = request.sampling_params.max_tokens - request.num_output_tokens - 1
    proposals = proposals[: max(min(num_left, token_budget - 1), 0)]
    if not block_manager.can_allocate(request, 1 + len(proposals)):
        return []
    return proposals


def apply_verified_step(
    output: SchedulerOutput,
    tokens: list[tuple[ScheduledRequest, int]],
    stats: SpecDecodingStats,
    finish: Callable[[Request, RequestStatus], None],
) -> list[Request]:
    """``Scheduler.update_from_output`` for a step that verified proposals: each producing
    request takes its run of tokens (``apply_verified_tokens``); those that end are handed to
    ``finish`` (the scheduler's) and returned."""
    runs: dict[int, list[int]] = {}
    for scheduled, token_id in tokens:
        runs.setdefault(id(scheduled), []).append(token_id)
    finished = []
    for scheduled in output.producing_requests:
        request = scheduled.request
        request.num_output_placeholders -= 1
        if request.is_finished:
            continue
        num_proposals = len(scheduled.spec_token_ids)
        run = runs.get(id(scheduled), [])
        status = apply_verified_tokens(request, num_proposals, run, check_stop, stats)
        if status is not None:
            finish(request, status)
            finished.append(request)
    return finished


def apply_verified_tokens(
    request: Request,
    num_proposals: int,
    token_ids: list[int],
    check_stop: Callable[[Request, int], RequestStatus | None],
    stats: SpecDecodingStats,
) -> RequestStatus | None:
    """Append a verified request's produced tokens (``token_ids``: its accepted proposals, then the
    target's token) one by one, stopping at the first that ends it; the status it finished with,
    or None. ``num_computed_tokens`` moves back past the rejected proposals."""
    if not token_ids:
        raise RuntimeError(f"request {request.request_id!r}: a verify produced no token")
    num_accepted = len(token_ids) - 1
    if num_proposals:
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposals
        stats.num_accepted_tokens += num_accepted
    request.num_computed_tokens -= num_proposals - num_accepted  # their KV is overwritten next
    for token_id in token_ids:
        request.output_token_ids.append(token_id)
        status = check_stop(request, token_id)
        if status is not None:
            return status
    return None
