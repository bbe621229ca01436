"""``AsyncLLMEngine``: one engine loop serving every live request of an asyncio program.

The ``LLMEngine`` belongs to one dedicated thread, the engine loop: it takes new requests and
aborts from a thread-safe queue, runs ``step()`` while any request is unfinished (continuous
batching across all callers), and after each step hands every request's new tokens back to the
event loop through ``loop.call_soon_threadsafe`` into that request's ``asyncio.Queue``. So the
event loop (HTTP parsing, streaming, metrics) never waits for a decode step, and a step never
waits for the event loop. The engine and the scheduler are touched by the engine thread only;
the event loop reads the ``EngineStats`` snapshot the loop publishes after every step.

The number of live requests is bounded (``max_num_seqs`` running plus ``max_waiting_requests``
queued): past it ``generate`` raises ``QueueFullError`` at once instead of queueing without
bound. A caller that stops iterating ``generate`` (a client that went away) aborts its request,
which frees its KV blocks and state slot on the engine's next turn. This module knows nothing of
HTTP or text: it moves token ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pieceworks.engine.llm_engine import LLMEngine
from pieceworks.engine.request import Request
from pieceworks.engine.sampling_params import SamplingParams
from pieceworks.logger import init_logger

logger = init_logger(__name__)

# How long the idle engine loop sleeps before it looks at its stop flag again.
_IDLE_POLL_SECONDS = 0.5


class QueueFullError(RuntimeError):
    """The engine already holds as many live requests as it accepts; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


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


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine loop, published after every step for the event loop to read."""

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
class _Stream:
    """The engine thread's view of one live request: where its deltas go."""

    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[RequestDelta]
    request: Request | None = None
    num_sent: int = 0


class AsyncLLMEngine:
    """Runs ``engine`` on its own thread; ``generate`` streams a request's tokens to asyncio."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        self.engine = engine
        self.max_live_requests = engine.config.scheduler_config.max_num_seqs + max_waiting_requests
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._num_live = 0  # event loop only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._num_steps = 0
        self._num_aborted = 0
        self.stats = self._snapshot()

    # -- event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine loop thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pieceworks-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_live_requests(self) -> int:
        return self._num_live

    def reserve(self, num_requests: int) -> None:
        """Claim room for ``num_requests`` new requests, or raise ``QueueFullError``."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop stopped on an error: {self.error!r}")
        if self._stop.is_set():
            raise QueueFullError("the server is shutting down and accepts no new requests")
        if self._num_live + num_requests > self.max_live_requests:
            raise QueueFullError(
                f"{self._num_live} requests are live and at most {self.max_live_requests} are "
                "accepted (max_num_seqs running + max_waiting_requests queued); retry later"
            )
        self._num_live += num_requests

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        reserved: bool = False,
    ) -> AsyncIterator[RequestDelta]:
        """Yield the request's deltas until it finishes; leaving early aborts it.

        Without ``reserved`` the call claims its own room (``QueueFullError`` when full).
        """
        if not reserved:
            self.reserve(1)
        request_id = request_id or uuid.uuid4().hex
        sink: asyncio.Queue[RequestDelta] = asyncio.Queue()
        stream = _Stream(asyncio.get_running_loop(), sink)
        finished = False
        try:
            self._commands.put(("add", (request_id, list(prompt_token_ids), params, stream)))
            while not finished:
                delta = await sink.get()
                finished = delta.finished
                yield delta
        finally:
            self._num_live -= 1
            if not finished:  # the caller went away (or was cancelled): free its cache now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request on the engine's next turn (unknown or finished ids are ignored)."""
        self._commands.put(("abort", request_id))

    def stop(self, request_id: str) -> None:
        """Finish a request with reason "stop" on the engine's next turn (its text reached a
        stop string), freeing its cache; unknown or finished ids are ignored."""
        self._commands.put(("stop", request_id))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine loop once no request is left (callers drain first), then free it."""
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()

    # -- engine-thread side ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if idle and self._stop.is_set():
                    return
                self._apply_commands(block=idle)
                if self.engine.has_unfinished_requests():
                    self.engine.step()
                    self._num_steps += 1
                    self._publish()
                self.stats = self._snapshot()
        except BaseException as error:  # the loop is dead: tell every caller, keep the reason
            logger.exception("engine loop stopped on an error")
            self.error = error
            self._fail_all(f"the engine failed: {error!r}")

    def _apply_commands(self, block: bool) -> None:
        """Apply every queued add and abort; when idle, first wait a while for one."""
        try:
            if block:
                command = self._commands.get(timeout=_IDLE_POLL_SECONDS)
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "add":
            request_id, prompt_token_ids, params, stream = payload
            try:
                stream.request = self.engine.add_request(prompt_token_ids, params, request_id)
            except ValueError as error:
                self._send(stream, RequestDelta(request_id, [], 0, error=str(error)))
                return
            self._streams[request_id] = stream
        elif kind == "abort":
            if self.engine.abort_request(payload):
                self._num_aborted += 1
                self._publish()
        elif kind == "stop":
            if self.engine.stop_request(payload):
                self._publish()

    def _publish(self) -> None:
        """Send each live request the tokens it gained since the last send; drop finished ones."""
        done = []
        for request_id, stream in self._streams.items():
            request = stream.request
            assert request is not None
            num_tokens = len(request.output_token_ids)
            if num_tokens == stream.num_sent and not request.is_finished:
                continue
            delta = RequestDelta(
                request_id,
                request.output_token_ids[stream.num_sent : num_tokens],
                num_tokens,
                request.finish_reason,
                logprobs=_new_logprobs(request, stream.num_sent, num_tokens),
            )
            stream.num_sent = num_tokens
            self._send(stream, delta)
            if request.is_finished:
                done.append(request_id)
        for request_id in done:
            del self._streams[request_id]

    def _fail_all(self, reason: str) -> None:
        for request_id, stream in self._streams.items():
            delta = RequestDelta(request_id, [], stream.num_sent, error=reason, engine_failed=True)
            self._send(stream, delta)
        self._streams.clear()
        while True:  # requests still queued for adding get the same answer
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                delta = RequestDelta(payload[0], [], 0, error=reason, engine_failed=True)
                self._send(payload[3], delta)

    @staticmethod
    def _send(stream: _Stream, delta: RequestDelta) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.sink.put_nowait, delta)
        except RuntimeError:  # that event loop is closed: nobody is listening any more
            pass

    def _snapshot(self) -> EngineStats:
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


def _new_logprobs(request: Request, start: int, end: int) -> list[Any] | None:
    """The engine's log-probability entries of output tokens [start, end) when the request set
    ``SamplingParams.logprobs``: one per token, appended with the token."""
    if request.sampling_params.logprobs is None:
        return None
    return list(request.output_logprobs[start:end])
