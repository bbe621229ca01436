"""``EngineCore``: the serving engine loop's work, free of threads, processes and asyncio.

The core owns an ``LLMEngine`` and turns commands into engine calls and engine steps into
messages. Commands are tuples: ``("add", request_id, prompt_token_ids, params)``, ``("abort",
request_id)``, ``("stop", request_id)`` and ``("shutdown",)``. After each turn of the loop the
core hands back one ``EngineCoreOutputs``: every request's new tokens of that turn (one
``RequestDelta`` each, with its log-probabilities and finish reason), the engine's refusals of
new requests, and the ``EngineStats`` snapshot, coalesced into one message however many requests
are live. ``run_engine_loop`` is the loop itself; where it runs (a thread of the server, or the
engine process of ``engine/core_process.py``) only changes how commands arrive and outputs
leave. The front end (``engine/async_engine.py``) dispatches the deltas to each request's queue.
This module moves token ids; text is the front end's business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pieceworks.engine.llm_engine import LLMEngine
from pieceworks.scheduler.request import Request

# How long the idle engine loop waits for a command before it looks again.
IDLE_POLL_SECONDS = 0.5

Command = tuple[Any, ...]


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
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled as constructor arguments: a third less time than a dataclass's state dict, on
        # the message that carries every live request's delta each step.
        return (
            RequestDelta,
            (self.request_id, self.new_token_ids, self.num_output_tokens, self.finish_reason,
             self.error, self.logprobs, self.engine_failed),
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


class EngineCore:
    """Applies commands to ``engine`` and collects what each turn changed, per request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._requests: dict[str, Request] = {}  # live requests by id
        self._num_sent: dict[str, int] = {}  # output tokens already handed out, per request
        self._deltas: list[RequestDelta] = []
        self._num_steps = 0
        self._num_aborted = 0

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def apply(self, command: Command) -> None:
        """Apply one ``add``, ``abort`` or ``stop`` command (unknown or finished ids are no-ops)."""
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            if self.engine.abort_request(command[1]):
                self._num_aborted += 1
                self._collect()
        elif kind == "stop":
            if self.engine.stop_request(command[1]):
                self._collect()
        else:
            raise ValueError(f"unknown engine command {kind!r}")

    def _add(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        try:
            request = self.engine.add_request(prompt_token_ids, params, request_id)
        except ValueError as error:  # the request can never run: tell its caller why
            self._deltas.append(RequestDelta(request_id, [], 0, error=str(error)))
            return
        self._requests[request_id] = request
        self._num_sent[request_id] = 0

    def step(self) -> None:
        """Run one engine step and collect every request's new tokens."""
        self.engine.step()
        self._num_steps += 1
        self._collect()

    def abort_all(self) -> None:
        """Abort every live request (the loop is shutting down)."""
        for request_id in list(self._requests):
            self.apply(("abort", request_id))

    def _collect(self) -> None:
        """A delta for each live request that gained tokens or finished; forget finished ones."""
        finished = []
        for request_id, request in self._requests.items():
            num_sent = self._num_sent[request_id]
            num_tokens = len(request.output_token_ids)
            if num_tokens == num_sent and not request.is_finished:
                continue
            self._deltas.append(
                RequestDelta(
                    request_id,
                    request.output_token_ids[num_sent:num_tokens],
                    num_tokens,
                    request.finish_reason,
                    logprobs=_new_logprobs(request, num_sent, num_tokens),
                )
            )
            self._num_sent[request_id] = num_tokens
            if request.is_finished:
                finished.append(request_id)
        for request_id in finished:
            del self._requests[request_id], self._num_sent[request_id]

    def take_outputs(self) -> EngineCoreOutputs:
        """The deltas collected since the last call, with the current stats."""
        deltas, self._deltas = self._deltas, []
        return EngineCoreOutputs(deltas, self.stats())

    def stats(self) -> EngineStats:
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_steps=self._num_steps,
            num_aborted=self._num_aborted,
        )


def run_engine_loop(
    core: EngineCore,
    receive: Callable[[float], list[Command]],
    send: Callable[[EngineCoreOutputs], None],
) -> None:
    """Serve commands until ``("shutdown",)``: apply what arrived, step while any request is
    unfinished, and send one ``EngineCoreOutputs`` per turn in which anything happened.

    ``receive(timeout)`` returns the commands that arrived, waiting up to ``timeout`` seconds
    for the first (0 while requests run: a step never waits for a command). On shutdown the
    requests still live are aborted and their final deltas sent.
    """
    while True:
        timeout = 0.0 if core.has_unfinished_requests() else IDLE_POLL_SECONDS
        commands = receive(timeout)
        for command in commands:
            if command[0] == "shutdown":
                core.abort_all()
                send(core.take_outputs())
                return
            core.apply(command)
        stepped = core.has_unfinished_requests()
        if stepped:
            core.step()
        if commands or stepped:
            send(core.take_outputs())


def _new_logprobs(request: Request, start: int, end: int) -> list[Any] | None:
    """The engine's log-probability entries of output tokens [start, end) when the request set
    ``SamplingParams.logprobs``: one per token, appended with the token."""
    if request.sampling_params.logprobs is None:
        return None
    return list(request.output_logprobs[start:end])
