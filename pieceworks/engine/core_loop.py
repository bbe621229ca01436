"""``EngineCoreLoop``: the serving engine loop's work, free of threads, processes and asyncio.

The loop owns an ``EngineCore`` (``engine/core.py``: scheduler, executor and sampler, one
``step`` at a time) and turns the typed commands of ``engine/messages.py`` into engine calls and
engine steps into messages. After each turn it hands back one ``EngineCoreOutputs``: every
request's new tokens of that turn (one ``RequestDelta`` each, with its log-probabilities and
finish reason), the engine's refusals of new requests, and the ``EngineStats`` snapshot,
coalesced into one message however many requests are live. ``run_busy_loop`` is the loop itself;
where it runs (a thread of the server, ``InprocEngineClient``, or the engine process of
``engine/core_process.py``) only changes how commands arrive and outputs leave. The front end
(``engine/async_engine.py``) dispatches the deltas to each request's queue. This module moves
token ids; text is the front end's business.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pieceworks.engine.core import EngineCore, StepFailedError
from pieceworks.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineCommand,
    EngineCoreOutputs,
    EngineStats,
    RequestDelta,
    Shutdown,
    StopRequest,
)
from pieceworks.scheduler.request import Request

# How long the idle engine loop waits for a command before it looks again.
IDLE_POLL_SECONDS = 0.5
# Steps failing one after another, each failing only its own requests, before the loop takes the
# engine for broken (a lost device fails every step) and stops.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineCoreLoop:
    """Applies commands to an ``EngineCore`` and collects what each turn changed, per request.

    vLLM's ``EngineCoreProc`` is its engine core run in a busy loop in a process of its own; this
    class is that busy loop without the process (the name says so): the same loop serves the
    engine process (``engine/core_process.py``) and the in-process thread of
    ``InprocEngineClient``, which differ only in how commands arrive and outputs leave.
    """

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self._requests: dict[str, Request] = {}  # live requests by id
        self._num_sent: dict[str, int] = {}  # output tokens already handed out, per request
        self._deltas: list[RequestDelta] = []
        self._num_steps = 0
        self._num_aborted = 0
        self._num_consecutive_failures = 0
        self._handlers: dict[type, Callable[[Any], None]] = {
            AddRequest: self._add,
            AbortRequest: self._abort,
            StopRequest: self._stop,
        }

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def apply(self, command: EngineCommand) -> None:
        """Apply one ``AddRequest``, ``AbortRequest`` or ``StopRequest`` (unknown or finished
        ids are no-ops); any other message raises ValueError."""
        handler = self._handlers.get(type(command))
        if handler is None:
            raise ValueError(f"unknown engine command {command!r}")
        handler(command)

    def _add(self, command: AddRequest) -> None:
        request_id = command.request_id
        try:
            request = self.engine_core.add_request(
                command.prompt_token_ids,
                command.params,
                request_id,
                command.priority,
                defer_grammar=True,  # the first constrained request does not hold the loop
            )
        except ValueError as error:  # the request can never run: tell its caller why
            self._deltas.append(RequestDelta(request_id, [], 0, error=str(error)))
            return
        self._requests[request_id] = request
        self._num_sent[request_id] = 0

    def _abort(self, command: AbortRequest) -> None:
        if self.engine_core.abort_request(command.request_id):
            self._num_aborted += 1
            self._collect()

    def _stop(self, command: StopRequest) -> None:
        if self.engine_core.stop_request(command.request_id):
            self._collect()

    def step(self) -> None:
        """Run one engine step and collect every request's new tokens. A step that fails
        (``StepFailedError``: the engine aborted that step's requests) ends those requests with
        its error and the loop carries on; several failing in a row stop the loop."""
        try:
            self.engine_core.step()
        except StepFailedError as error:
            self._num_consecutive_failures += 1
            if self._num_consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            self._fail(error.request_ids, str(error))
        else:
            self._num_consecutive_failures = 0
        for request_id, reason in self.engine_core.grammar_waitlist.take_failed():
            self._fail([request_id], reason)  # its grammar did not compile: refused
        self._num_steps += 1
        self._collect()

    def _fail(self, request_ids: list[str], reason: str) -> None:
        """End the live requests of ``request_ids`` with ``reason`` as their error."""
        for request_id in request_ids:
            if self._requests.pop(request_id, None) is None:
                continue
            num_sent = self._num_sent.pop(request_id)
            self._deltas.append(RequestDelta(request_id, [], num_sent, error=reason))

    def abort_all(self) -> None:
        """Abort every live request (the loop is shutting down)."""
        for request_id in list(self._requests):
            self._abort(AbortRequest(request_id))

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
                    prompt_logprobs=_prompt_logprobs(request, num_sent),
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
        scheduler = self.engine_core.scheduler
        blocks = scheduler.block_manager
        spec = scheduler.spec_decoding_stats
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(self.engine_core.grammar_waitlist),
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_steps=self._num_steps,
            num_aborted=self._num_aborted,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            num_constrained_steps=self.engine_core.num_constrained_steps,
            prefix_cache_queries=blocks.num_prefix_cache_queries,
            prefix_cache_hits=blocks.num_prefix_cache_hits,
            request_queue_time=scheduler.timing.queue.snapshot(),
            request_prefill_time=scheduler.timing.prefill.snapshot(),
        )

    def run_busy_loop(
        self,
        receive: Callable[[float], list[EngineCommand]],
        send: Callable[[EngineCoreOutputs], None],
    ) -> None:
        """Serve commands until ``Shutdown``: apply what arrived, step while any request is
        unfinished, and send one ``EngineCoreOutputs`` per turn in which anything happened.

        ``receive(timeout)`` returns the commands that arrived, waiting up to ``timeout`` seconds
        for the first (0 while requests run: a step never waits for a command). On shutdown the
        requests still live are aborted and their final deltas sent.
        """
        while True:
            timeout = 0.0 if self.has_unfinished_requests() else IDLE_POLL_SECONDS
            commands = receive(timeout)
            for command in commands:
                if isinstance(command, Shutdown):
                    self.abort_all()
                    send(self.take_outputs())
                    return
                self.apply(command)
            stepped = self.has_unfinished_requests()
            if stepped:
                self.step()
            if commands or stepped:
                send(self.take_outputs())


def _prompt_logprobs(request: Request, num_sent: int) -> list[Any] | None:
    """The prompt's log-probability entries (the first None) on the request's first delta, when
    it set ``SamplingParams.prompt_logprobs``; its prefill is complete by then."""
    if request.sampling_params.prompt_logprobs is None or num_sent:
        return None
    return list(request.prompt_logprobs)


def _new_logprobs(request: Request, start: int, end: int) -> list[Any] | None:
    """The engine's log-probability entries of output tokens [start, end) when the request set
    ``SamplingParams.logprobs``: one per token, appended with the token."""
    if request.sampling_params.logprobs is None:
        return None
    return list(request.output_logprobs[start:end])
