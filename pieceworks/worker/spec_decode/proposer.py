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

from pieceworks.scheduler.request import Request
from pieceworks.speculative_config import SpeculativeConfig


class Proposer:
    """Guesses the next tokens of a batch of requests."""

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


def propose_for_running(proposer: Proposer, running: Sequence[Request]) -> None:
    """Set every running request's ``spec_token_ids`` for the next step: the proposer's guesses
    for a decoding request (its last token known on the host), none for any other, nor for one
    with structured output (its grammar masks one position per step)."""
    decoding = []
    for request in running:
        request.spec_token_ids = []
        if (
            request.num_uncomputed_tokens == 1
            and request.num_computed_tokens > 0
            and request.num_output_placeholders == 0
            and not request.sampling_params.structured_outputs
        ):
            decoding.append(request)
    proposals = proposer.propose_requests(decoding)
    for request, spec_token_ids in zip(decoding, proposals):
        request.spec_token_ids = spec_token_ids
