"""The typed messages between the engine loop and its front end, in both directions.

Down (front end to ``EngineCoreLoop``): one dataclass per command, ``AddRequest``,
``AbortRequest``, ``StopRequest`` and ``Shutdown``; ``EngineCommand`` is their union, and the loop
dispatches on the message's type. Up: one ``EngineCoreOutputs`` per turn of the loop, carrying a
``RequestDelta`` for every request that changed and the ``EngineStats`` snapshot. Every message
pickles (it may cross the engine process's pipes); ``RequestDelta`` pickles as its constructor
arguments, the cheapest form, because one goes up for every live request every step. This module
holds data only: no engine, no pipes, no asyncio.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.request_timing import PhaseSnapshot

# Commands pickle as their constructor arguments (``__reduce__``): less than half the time of a
# dataclass's default reduction, on every request's way into the engine process.


@dataclasses.dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request; one the engine refuses comes back as a ``RequestDelta`` with ``error``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower first under scheduling_policy "priority"; else it must be 0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (AddRequest, (self.request_id, self.prompt_token_ids, self.params, self.priority))


@dataclasses.dataclass(frozen=True, slots=True)
class AbortRequest:
    """Finish a request now with reason "abort" (its caller went away); unknown ids: a no-op."""

    request_id: str

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (AbortRequest, (self.request_id,))


@dataclasses.dataclass(frozen=True, slots=True)
class StopRequest:
    """Finish a request now with reason "stop" (its text reached a stop string); unknown ids: a
    no-op."""

    request_id: str

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (StopRequest, (self.request_id,))


@dataclasses.dataclass(frozen=True, slots=True)
class Shutdown:
    """End the loop: abort what is still live and send its last outputs."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Shutdown, ())


EngineCommand = AddRequest | AbortRequest | StopRequest | Shutdown


@dataclasses.dataclass
class RequestDelta:
    """What one engine step added to a request: its new token ids, and how it ended if it did.

    ``error`` is set (and nothing else) when the engine refused the request when it was added,
    with the engine's reason, e.g. a prompt that can never fit the KV cache; or, with
    ``engine_failed``, when the engine loop died under it.
    """

    request_id: str
    new_token_ids: list[int]
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[Any] | None = None  # one entry per new token, when the request asked
    engine_failed: bool = False
    # Per prompt token (the first None), once, on the request's first delta, when it asked
    # for ``prompt_logprobs``.
    prompt_logprobs: list[Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def merge(self, later: RequestDelta) -> RequestDelta:
        """This delta followed by ``later`` of the same request, as one delta."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = [*(self.logprobs or []), *(later.logprobs or [])]
        return RequestDelta(
            self.request_id,
            self.new_token_ids + later.new_token_ids,
            later.num_output_tokens,
            later.finish_reason,
            later.error,
            logprobs,
            later.engine_failed,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled as constructor arguments: a third less time than a dataclass's state dict, on
        # the message that carries every live request's delta each step.
        return (
            RequestDelta,
            (self.request_id, self.new_token_ids, self.num_output_tokens, self.finish_reason,
             self.error, self.logprobs, self.engine_failed, self.prompt_logprobs),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine loop, published after every turn for the front end to read."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_steps: int = 0
    num_aborted: int = 0  # requests aborted while unfinished (callers that went away)
    # Speculative decoding totals (``scheduler/spec_decode.py``: SpecDecodingStats); 0 without.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    num_constrained_steps: int = 0  # steps with a structured-output request (one step each)
    # Tokens of admitted requests looked up in the prefix cache, and those found (cumulative).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Requests' engine queue and prefill times (``scheduler/request_timing.py``), cumulative.
    request_queue_time: PhaseSnapshot | None = None
    request_prefill_time: PhaseSnapshot | None = None

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclasses.dataclass
class EngineCoreOutputs:
    """One turn of the engine loop: the deltas of every request that changed, and the stats.

    ``failure`` is set on the last message of an engine that died: the reason every live
    request (and every later one) fails with.
    """

    deltas: list[RequestDelta]
    stats: EngineStats | None
    failure: str | None = None
