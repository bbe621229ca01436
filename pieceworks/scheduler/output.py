"""What one step schedules: ``SchedulerOutput``, its ``ScheduledRequest`` items, and the pairing of
the tokens a step sampled with the requests that produce them.

``Scheduler.schedule`` builds a ``SchedulerOutput``; the model runner reads it (the worker may
import these types, never the scheduler itself) and ``Scheduler.update_from_output`` takes it back
with the sampled tokens. ``PLACEHOLDER_TOKEN_ID`` marks a token still on the device (async
scheduling). A speculative decode also computes its proposals (``ScheduledRequest.spec_token_ids``)
and gets up to one token per proposal plus one (``SchedulerOutput.num_verify_columns`` per request,
``REJECTED_TOKEN_ID`` past its accepted run).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Final

from pieceworks.scheduler.request import Request

# Stands in for a token sampled on the device that the host has not seen yet (async scheduling).
PLACEHOLDER_TOKEN_ID: Final = -1
# Fills a speculative decode's columns past the tokens it produced (its rejected proposals).
REJECTED_TOKEN_ID: Final = -1


@dataclasses.dataclass
class ScheduledRequest:
    """One request's work this step: compute ``num_new_tokens`` tokens from ``num_computed_tokens``.

    Everything a model runner reads is snapshotted when scheduled (the request's own counter then
    advances by ``num_new_tokens``). ``produces_token`` is True when the step reaches the end of
    the request's tokens (``num_computed_tokens + num_new_tokens == request.num_tokens``): the
    logits of its last scheduled position are sampled and the token is appended. A chunk of a
    prompt that stops short of its end produces no token. ``is_decode``: one token on top of a
    computed context, sampled (the shape a decode graph serves). ``new_token_ids`` are the token
    ids this step computes; one still on the device (async scheduling) is
    ``PLACEHOLDER_TOKEN_ID``. A speculative decode (``spec_token_ids``, the proposer's guesses for
    the tokens after its last one) computes them too: ``num_new_tokens`` is one plus their number
    and ``new_token_ids`` ends with them; it is still ``is_decode``.
    """

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = dataclasses.field(init=False)
    produces_token: bool = dataclasses.field(init=False)
    is_decode: bool = dataclasses.field(init=False)
    new_token_ids: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        request, num_new_tokens = self.request, self.num_new_tokens
        self.num_computed_tokens = computed = request.num_computed_tokens
        num_spec_tokens = len(self.spec_token_ids)
        end = computed + num_new_tokens - num_spec_tokens  # the proposals are not its tokens yet
        self.produces_token = end == request.num_tokens
        self.is_decode = num_new_tokens - num_spec_tokens == 1 and self.produces_token
        self.is_decode = self.is_decode and computed > 0
        self.new_token_ids = _token_ids(request, computed, end) + self.spec_token_ids

    def detached(self) -> ScheduledRequest:
        """A copy for another rank: the snapshot plus a request holding only what a runner reads
        (id, sampling parameters, blocks, state slot), not the whole token history."""
        detached = copy.copy(self)  # the snapshot fields as they are
        detached.request = self.request.runner_view()
        return detached


def _token_ids(request: Request, start: int, end: int) -> list[int]:
    """Token ids at positions [start, end); a token still on the device is a placeholder."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt_tokens = len(prompt)
    # Slice the two lists separately: a decode must not copy the whole sequence each step.
    if start >= num_prompt_tokens:  # a decode: generated tokens only
        ids = output[start - num_prompt_tokens : end - num_prompt_tokens]
    else:
        ids = prompt[start:end] + output[: max(end - num_prompt_tokens, 0)]
    if len(ids) < end - start:
        ids += [PLACEHOLDER_TOKEN_ID] * (end - start - len(ids))
    return ids


@dataclasses.dataclass
class SchedulerOutput:
    """One step's batch: decodes first, then prefills (new, resumed or continuing chunks).

    ``preempted_requests`` were evicted this step (their blocks and state slots are already free);
    a runner that keeps per-request state drops it for them. With ``num_steps`` > 1 the batch is
    a uniform decode run ``num_steps`` times, positions advancing by one each time, and every
    producing request samples ``num_steps`` tokens. The counts over the batch are
    computed once, on first use: the batch never changes after ``schedule`` returns it.
    """

    scheduled_requests: list[ScheduledRequest]
    preempted_requests: list[Request] = dataclasses.field(default_factory=list)
    # Decode steps run back to back (each scheduled request a decode when > 1); every field
    # above describes the first of them.
    num_steps: int = 1
    # The structured-output token bitmask of the producing requests (a CPU int32 tensor, one
    # row each), set by the engine core when one of them is constrained, once the runner has
    # launched the step's forward and asks for it (it reaches other ranks in a broadcast of its
    # own); None otherwise.
    grammar_bitmask: Any = None

    @property
    def num_requests(self) -> int:
        return len(self.scheduled_requests)

    @functools.cached_property
    def num_scheduled_tokens(self) -> int:
        return sum(scheduled.num_new_tokens for scheduled in self.scheduled_requests)

    @functools.cached_property
    def max_query_len(self) -> int:
        """The most tokens any request computes this step (0 for an empty step)."""
        return max((scheduled.num_new_tokens for scheduled in self.scheduled_requests), default=0)

    @functools.cached_property
    def num_decodes(self) -> int:
        return sum(scheduled.is_decode for scheduled in self.scheduled_requests)

    @property
    def is_uniform_decode(self) -> bool:
        """Every scheduled request is a decode (one token each): a full decode graph can run it."""
        return self.uniform_decode_query_len == 1

    @functools.cached_property
    def num_spec_tokens(self) -> int:
        """Proposals verified this step, over all requests."""
        return sum(len(scheduled.spec_token_ids) for scheduled in self.scheduled_requests)

    @functools.cached_property
    def uniform_decode_query_len(self) -> int:
        """The query length shared by every scheduled request when all are decodes with the same
        number of proposals (1: plain decodes; 1 + k: a uniform verify batch), else 0."""
        if not self.scheduled_requests or self.num_decodes != self.num_requests:
            return 0
        query_lens = {scheduled.num_new_tokens for scheduled in self.scheduled_requests}
        return query_lens.pop() if len(query_lens) == 1 else 0

    @functools.cached_property
    def num_verify_columns(self) -> int:
        """Tokens the runner returns per producing request: one more than the most proposals
        any of them verifies (1 without speculation)."""
        return 1 + max((len(item.spec_token_ids) for item in self.producing_requests), default=0)

    def detached(self) -> SchedulerOutput:
        """The step as another rank's runner needs it (see ``ScheduledRequest.detached``),
        preempted requests included, as runner views."""
        return SchedulerOutput(
            [item.detached() for item in self.scheduled_requests],
            [request.runner_view() for request in self.preempted_requests],
            self.num_steps,
            self.grammar_bitmask,
        )

    @functools.cached_property
    def producing_requests(self) -> list[ScheduledRequest]:
        """The scheduled requests that get a sampled token, in scheduled order."""
        return [scheduled for scheduled in self.scheduled_requests if scheduled.produces_token]


def pair_sampled_tokens(
    scheduler_output: SchedulerOutput, sampled_token_ids: Sequence[int]
) -> list[tuple[ScheduledRequest, int]]:
    """Pair each token with its request: step 0's tokens first, each step in scheduled order."""
    num_steps = scheduler_output.num_steps
    if scheduler_output.num_verify_columns > 1:
        return _verified_tokens(scheduler_output, sampled_token_ids)
    if num_steps == 1:
        return _tokens_per_request(scheduler_output, sampled_token_ids)
    producing = scheduler_output.producing_requests
    if len(sampled_token_ids) != num_steps * len(producing):
        raise ValueError(
            f"got {len(sampled_token_ids)} sampled tokens for {num_steps} decode steps of "
            f"{len(producing)} requests; pass {num_steps} tokens per request, step by step"
        )
    num_requests = len(producing)
    return [
        (producing[index % num_requests], int(token))
        for index, token in enumerate(sampled_token_ids)
    ]


def _tokens_per_request(
    scheduler_output: SchedulerOutput, sampled_token_ids: Sequence[int]
) -> list[tuple[ScheduledRequest, int]]:
    """Pair each scheduled request that produces a token with its token, in scheduled order."""
    producing = scheduler_output.producing_requests
    if len(sampled_token_ids) == len(producing):
        return [(scheduled, int(token)) for scheduled, token in zip(producing, sampled_token_ids)]
    scheduled_requests = scheduler_output.scheduled_requests
    if len(sampled_token_ids) == len(scheduled_requests):
        pairs = zip(scheduled_requests, sampled_token_ids)
        return [(scheduled, int(token)) for scheduled, token in pairs if scheduled.produces_token]
    raise ValueError(
        f"got {len(sampled_token_ids)} sampled tokens for a step of {len(scheduled_requests)} "
        f"requests of which {len(producing)} produce a token; pass one token per producing request"
    )


def _verified_tokens(
    scheduler_output: SchedulerOutput, sampled_token_ids: Sequence[int]
) -> list[tuple[ScheduledRequest, int]]:
    """A speculative step's tokens: ``num_verify_columns`` per producing request, row by row,
    ``REJECTED_TOKEN_ID`` past each request's produced run (dropped here)."""
    producing, columns = scheduler_output.producing_requests, scheduler_output.num_verify_columns
    if len(sampled_token_ids) != columns * len(producing):
        raise ValueError(
            f"got {len(sampled_token_ids)} tokens for a speculative step of {len(producing)} "
            f"producing requests; pass {columns} per request (REJECTED_TOKEN_ID past its run)"
        )
    return [
        (producing[index // columns], int(token))
        for index, token in enumerate(sampled_token_ids)
        if token != REJECTED_TOKEN_ID
    ]
