"""``Proposer``: what makes the guesses a speculative step verifies; ``propose_for_running``.

A proposer sees each decoding request's tokens (prompt and output so far) and returns up to
``num_speculative_tokens`` guesses for the tokens that follow. The engine asks it before every
step and hands the guesses to the scheduler (``Request.spec_token_ids``); the runner verifies
them against the target model in the step's one forward. A proposer may be wrong as often as it
likes: verification keeps exactly the target's tokens (greedy) or the target's distribution
(sampling), so only the speed depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pieceworks.scheduler.output import SchedulerOutput
from pieceworks.scheduler.request import Request
from pieceworks.speculative_config import SpeculativeConfig
from pieceworks.worker.spec_decode.backoff import ProposalBackoff


class Proposer:
    """Guesses the next tokens of a batch of requests.

    ``skips_steps``: the proposer keeps nothing per request that a step without a call would
    leave behind, so the engine may skip it for a request (``ProposalBackoff``) and schedule
    asynchronously between tries; a proposer that mirrors requests (a draft model) sets False.
    """

    skips_steps = True

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """At most ``num_speculative_tokens`` guesses for the tokens after ``token_ids`` (the
        request's prompt and output so far); [] when it has none. A proposer that keeps state
        per request overrides ``propose_requests`` instead."""
        raise NotImplementedError(f"{type(self).__name__} proposes per request")

    def propose_requests(self, requests: Sequence[Request]) -> list[list[int]]:
        """Guesses for each of the step's decoding requests (every other request of the last
        call is gone or not decoding now): ``propose`` of each one's tokens."""
        return [self.propose(request.all_token_ids) for request in requests]

    def release(self, request_id: str) -> None:
        """Forget what the proposer keeps for a finished request (nothing, by default)."""

    def shutdown(self) -> None:
        """Free what the proposer holds on the device (nothing, unless it runs a model)."""


def propose_for_running(
    proposer: Proposer, running: Sequence[Request], backoff: ProposalBackoff | None = None
) -> None:
    """Set every running request's ``spec_token_ids`` for the next step: the proposer's guesses
    for a decoding request (its last token known on the host), none for any other, nor for one
    with structured output (its grammar masks one position per step), nor for one that
    ``backoff`` has skip this step."""
    decoding = []
    for request in running:
        request.spec_token_ids = []
        eligible = (
            request.num_uncomputed_tokens == 1
            and request.num_computed_tokens > 0
            and request.num_output_placeholders == 0
            and not request.sampling_params.structured_outputs
        )
        if backoff is not None:
            eligible = backoff.should_propose(request, eligible)
        if eligible:
            decoding.append(request)
    proposals = proposer.propose_requests(decoding)
    for request, spec_token_ids in zip(decoding, proposals):
        request.spec_token_ids = spec_token_ids
        if backoff is not None:
            backoff.proposed(request, spec_token_ids)


def tokens_needed_next(
    output: SchedulerOutput, backoff: ProposalBackoff | None, running: Sequence[Request]
) -> bool:
    """Whether the engine must read the tokens of the step it launched (``output``) before
    scheduling the next: the step verified proposals (how many were accepted decides the next
    step's inputs), or without a ``backoff`` always, or a running request may be proposed for at
    the next step (its last token must be on the host): one that has started, has no
    structured output and is not skipping steps."""
    if output.num_verify_columns > 1 or backoff is None:
        return True
    return any(
        request.num_computed_tokens > 0
        and not request.sampling_params.structured_outputs
        and backoff.wants_to_propose(request)
        for request in running
    )
