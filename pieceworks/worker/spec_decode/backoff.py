"""``ProposalBackoff``: when a request stops being worth proposing for, and so worth a host sync.

A proposal needs the request's last token on the host, so a step that may propose for a request
must come after a step whose tokens the host has read: under async scheduling that is a host
sync, which leaves the device idle for the host's work between the steps, and a verify that
accepts nothing costs a wider forward for one token. Where the output does not repeat its
context (a random prompt, free prose) the n-gram proposer finds nothing or is wrong step after
step, and speculation would make decoding slower than without it.

The backoff keeps, per request, how many steps to skip before the next try: after a try that
produced no token beyond the target's own (no proposal found, or every proposal rejected) it
skips 1, 2, 4, ... up to ``MAX_SKIPPED_STEPS`` steps; a try that had a proposal accepted resets
it, so a request that copies its context proposes every step. A try is judged at the next call,
from how many output tokens the request gained since. Steps skipped this way need no sync: the
engine scheduling asynchronously reads the tokens of such steps one step late, as without
speculation (``EngineCore._step``), and syncs only where a request will try at the next step
(``wants_to_propose``) or the step verifies proposals.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pieceworks.scheduler.request import Request

# The most steps a request waits between two tries (the cap of the doubling): a request whose
# output starts repeating later loses at most this many steps of speculation, and one that never
# repeats costs a sync once per this many steps.
MAX_SKIPPED_STEPS = 16


@dataclasses.dataclass
class _Tries:
    """One request's state: steps left to skip, tries in a row that produced nothing, and the
    number of output tokens when the last try proposed (None: no try to judge)."""

    skip: int = 0
    failures: int = 0
    tried_at: int | None = None


class ProposalBackoff:
    """Per request: whether to propose at this step (``should_propose``), and whether it will
    want to at the next (``wants_to_propose``)."""

    def __init__(self, max_skipped_steps: int = MAX_SKIPPED_STEPS) -> None:
        self.max_skipped_steps = max_skipped_steps
        self._tries: dict[str, _Tries] = {}

    @classmethod
    def for_engine(cls, proposer: Any, async_scheduling: bool) -> ProposalBackoff | None:
        """A backoff where it saves host syncs: async scheduling and a ``proposer`` that may skip
        steps for a request (``Proposer.skips_steps``); else None (every step tries)."""
        if proposer is None or not proposer.skips_steps or not async_scheduling:
            return None
        return cls()

    def should_propose(self, request: Request, eligible: bool) -> bool:
        """Called once per engine step for every running request, before proposing: judges its
        last try if its tokens are in, counts the step down, and says whether to propose now
        (only for an ``eligible`` request: decoding, its last token on the host)."""
        tries = self._tries.setdefault(request.request_id, _Tries())
        if tries.tried_at is not None and eligible:
            gained = request.num_output_tokens - tries.tried_at
            self._judge(tries, accepted=gained > 1)
        if tries.skip > 0:
            tries.skip -= 1
            return False
        return eligible

    def proposed(self, request: Request, proposals: list[int]) -> None:
        """Record a try: an empty one failed now, a proposal is judged at the next call."""
        tries = self._tries[request.request_id]
        if proposals:
            tries.tried_at = request.num_output_tokens
        else:
            self._judge(tries, accepted=False)

    def wants_to_propose(self, request: Request) -> bool:
        """Whether ``request`` will try at the next step (it is not skipping)."""
        tries = self._tries.get(request.request_id)
        return tries is None or tries.skip == 0

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self._tries.pop(request_id, None)

    def _judge(self, tries: _Tries, accepted: bool) -> None:
        tries.tried_at = None
        if accepted:
            tries.failures, tries.skip = 0, 0
            return
        tries.failures += 1
        tries.skip = min(2 ** (tries.failures - 1), self.max_skipped_steps)
