"""``AsyncLLMEngine``: one engine loop serving every live request of an asyncio program.

The front end lives on the event loop: ``generate`` sends an ``add`` command and yields the
request's ``RequestDelta``s from an ``asyncio.Queue`` of its own; ``abort`` and ``stop`` send
their commands. The engine loop (``engine/core.py``: take commands, step while any request is
unfinished, one ``EngineCoreOutputs`` per turn carrying every request's new tokens and the
stats) runs behind an ``EngineClient``:

- ``EngineProcessClient`` (``engine/core_process.py``, what ``pieceworks serve`` uses): the
  engine in a process of its own, so its per-step host work never shares an interpreter lock
  with HTTP parsing, streaming and detokenization;
- ``InprocEngineClient`` (here): the engine in a thread of this process (tests, debugging,
  ``pieceworks serve --engine-in-process``).

Either way each turn's outputs reach ``_dispatch`` on the event loop, which puts each delta
into its request's queue: the event loop never waits for a step, and a step never waits for
the event loop. The number of live requests is bounded (``max_num_seqs`` running plus
``max_waiting_requests`` queued): past it ``generate`` raises ``QueueFullError`` at once
instead of queueing without bound. A caller that stops iterating ``generate`` (a client that
went away) aborts its request, which frees its KV blocks and state slot on the engine's next
turn. When the engine dies every live request gets a delta with ``engine_failed``, and every
later one ``EngineDeadError``. This module knows nothing of HTTP or text: it moves token ids.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from pieceworks.engine.core import (
    Command,
    EngineCore,
    EngineCoreOutputs,
    EngineStats,
    RequestDelta,
    run_engine_loop,
)
from pieceworks.engine.llm_engine import LLMEngine
from pieceworks.logger import init_logger
from pieceworks.sampling_params import SamplingParams

logger = init_logger(__name__)

__all__ = [
    "AsyncLLMEngine",
    "EngineClient",
    "EngineDeadError",
    "EngineStats",
    "InprocEngineClient",
    "QueueFullError",
    "RequestDelta",
]

OutputsHandler = Callable[[EngineCoreOutputs], None]


class QueueFullError(RuntimeError):
    """The engine already holds as many live requests as it accepts; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


class EngineClient(Protocol):
    """How the front end reaches an engine loop. ``start`` and ``send`` run on the event loop;
    ``on_outputs`` is called on ``loop``, once per engine turn, in order."""

    max_num_seqs: int
    initial_stats: EngineStats

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OutputsHandler) -> None: ...

    def send(self, command: Command) -> None: ...

    def is_alive(self) -> bool: ...

    def shutdown(self, timeout: float | None) -> None: ...


class InprocEngineClient:
    """The engine loop on a thread of this process, fed through a thread-safe queue."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.core = EngineCore(engine)
        self.max_num_seqs = engine.config.scheduler_config.max_num_seqs
        self.initial_stats = self.core.stats()
        self._commands: queue.Queue[Command] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OutputsHandler) -> None:
        def send(outputs: EngineCoreOutputs) -> None:
            try:
                loop.call_soon_threadsafe(on_outputs, outputs)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

        def run() -> None:
            try:
                run_engine_loop(self.core, self._receive, send)
            except BaseException as error:  # the loop is dead: tell the front end why
                logger.exception("engine loop stopped on an error")
                send(EngineCoreOutputs([], None, failure=f"the engine failed: {error!r}"))

        self._thread = threading.Thread(target=run, name="pieceworks-engine", daemon=True)
        self._thread.start()

    def _receive(self, timeout: float) -> list[Command]:
        try:
            commands = [
                self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
            ]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float | None) -> None:
        """Stop the loop (requests still live are aborted), then free the engine."""
        self._commands.put(("shutdown",))
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()


class AsyncLLMEngine:
    """The asyncio front end of an engine loop; ``generate`` streams a request's deltas."""

    def __init__(self, client: EngineClient, max_waiting_requests: int = 256) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        self.client = client
        self.max_live_requests = client.max_num_seqs + max_waiting_requests
        self.stats = client.initial_stats
        self.error: str | None = None  # why the engine died, once it has
        self._queues: dict[str, asyncio.Queue[RequestDelta]] = {}
        self._num_live = 0
        self._started = False
        self._stopped = False

    def start(self) -> None:
        """Connect the engine loop's outputs to the running event loop (idempotent)."""
        if not self._started:
            self._started = True
            self.client.start(asyncio.get_running_loop(), self._dispatch)

    @property
    def is_running(self) -> bool:
        return self._started and self.error is None and self.client.is_alive()

    @property
    def num_live_requests(self) -> int:
        return self._num_live

    def reserve(self, num_requests: int) -> None:
        """Claim room for ``num_requests`` new requests, or raise ``QueueFullError``."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        if self._stopped:
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

        A caller that falls behind the engine gets the deltas that piled up merged into one
        (vLLM's front end does the same), so a busy server sends fewer, larger chunks instead of
        falling further behind. Without ``reserved`` the call claims its own room
        (``QueueFullError`` when full).
        """
        if not reserved:
            self.reserve(1)
        request_id = request_id or uuid.uuid4().hex
        sink: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._queues[request_id] = sink
        finished = False
        try:
            if self.error is not None:
                sink.put_nowait(_failed(request_id, self.error))
            else:
                self.client.send(("add", request_id, list(prompt_token_ids), params))
            while not finished:
                delta = await sink.get()
                while not delta.finished and not sink.empty():  # the caller fell behind
                    delta = delta.merge(sink.get_nowait())
                finished = delta.finished
                yield delta
        finally:
            del self._queues[request_id]
            self._num_live -= 1
            if not finished:  # the caller went away (or was cancelled): free its cache now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request on the engine's next turn (unknown or finished ids are ignored)."""
        self._send(("abort", request_id))

    def stop(self, request_id: str) -> None:
        """Finish a request with reason "stop" on the engine's next turn (its text reached a
        stop string), freeing its cache; unknown or finished ids are ignored."""
        self._send(("stop", request_id))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine loop (callers drain first; what is still live is aborted) and free
        the engine; idempotent."""
        if not self._stopped:
            self._stopped = True
            self.client.shutdown(timeout)

    def _send(self, command: Command) -> None:
        if self.error is None and not self._stopped:
            self.client.send(command)

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        """One engine turn, on the event loop: each delta to its request's queue."""
        if outputs.stats is not None:
            self.stats = outputs.stats
        for delta in outputs.deltas:
            sink = self._queues.get(delta.request_id)
            if sink is not None:  # None: its caller already left
                sink.put_nowait(delta)
        if outputs.failure is not None and self.error is None:
            logger.error("the engine stopped: %s", outputs.failure)
            self.error = outputs.failure
            for request_id, sink in self._queues.items():
                sink.put_nowait(_failed(request_id, outputs.failure))


def _failed(request_id: str, reason: str) -> RequestDelta:
    return RequestDelta(request_id, [], 0, error=reason, engine_failed=True)
