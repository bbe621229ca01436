"""``AsyncLLMEngine``: one engine loop serving every live request of an asyncio program.

The front end lives on the event loop: ``generate`` sends an ``AddRequest`` and yields the
request's ``RequestDelta``s from an ``asyncio.Queue`` of its own; ``abort`` and ``stop`` send an
``AbortRequest`` and a ``StopRequest`` (``engine/messages.py``). The engine loop
(``EngineCoreLoop``, ``engine/core_loop.py``: take commands, step while any request is
unfinished, one ``EngineCoreOutputs`` per turn carrying every request's new tokens and the
stats) runs behind an ``EngineClient`` (``engine/core_client.py``):

- ``EngineProcessClient`` (what ``pieceworks serve`` uses): the engine in a process of its own
  (``engine/core_process.py``), so its per-step host work never shares an interpreter lock
  with HTTP parsing, streaming and detokenization;
- ``InprocEngineClient``: the engine in a thread of this process (tests, debugging,
  ``pieceworks serve --engine-in-process``).

Either way the turns' outputs reach ``_dispatch`` on the event loop, in one callback, which
hands each delta to its request's sink (``DeltaSink``: ``generate``'s ``DeltaCollector``, or a
server's own through ``add_request``) and then runs the turn hooks (``add_turn_hook``: a server
detokenizes every stream of the turn there, together, and writes them): the event loop never
waits for a step, a step never waits for the event loop, and a reader wakes at most once per
turn. A front end that fell behind the engine gets the turns that piled up in one callback and
runs the hooks once for them, so its work per write is shared by several tokens and it catches
up instead of holding the engine back on a full pipe.
The number of live requests is bounded (``max_num_seqs`` running plus
``max_waiting_requests`` queued): past it ``generate`` raises ``QueueFullError`` at once
instead of queueing without bound. A caller that stops iterating ``generate`` (a client that
went away) aborts its request, which frees its KV blocks and state slot on the engine's next
turn. When the engine dies every live request gets a delta with ``engine_failed``, and every
later one ``EngineDeadError``. This module knows nothing of HTTP or text: it moves token ids.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from pieceworks.engine.core_client import EngineClient
from pieceworks.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineCommand,
    EngineCoreOutputs,
    RequestDelta,
    StopRequest,
)
from pieceworks.logger import init_logger
from pieceworks.sampling_params import SamplingParams

logger = init_logger(__name__)


class QueueFullError(RuntimeError):
    """The engine already holds as many live requests as it accepts; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


class DeltaSink(Protocol):
    """Where a request's deltas go; ``put`` runs on the event loop, inside ``_dispatch``."""

    def put(self, delta: RequestDelta) -> None: ...


class DeltaCollector:
    """A request's deltas for one reader: what piled up since the reader last took comes out
    as one merged delta (vLLM's ``RequestOutputCollector``), and a reader waiting for it wakes
    once however many deltas arrive before it runs. Nothing is merged past a finished delta."""

    def __init__(self) -> None:
        self._delta: RequestDelta | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, delta: RequestDelta) -> None:
        if self._delta is None:
            self._delta = delta
        elif not self._delta.finished:
            self._delta = self._delta.merge(delta)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestDelta:
        while self._delta is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        delta, self._delta = self._delta, None
        return delta


class AsyncLLMEngine:
    """The asyncio front end of an engine loop; ``generate`` streams a request's deltas."""

    def __init__(self, client: EngineClient, max_waiting_requests: int = 256) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
        self.client = client
        self.max_live_requests = client.max_num_seqs + max_waiting_requests
        self.stats = client.initial_stats
        self.error: str | None = None  # why the engine died, once it has
        self._sinks: dict[str, DeltaSink] = {}
        self._turn_hooks: list[Callable[[], None]] = []
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
        priority: int = 0,
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
        sink = DeltaCollector()
        finished = False
        try:
            self.add_request(request_id, prompt_token_ids, params, sink, priority=priority)
            while not finished:
                delta = await sink.get()
                finished = delta.finished
                yield delta
        finally:  # unfinished: the caller went away (or was cancelled): free its cache now
            self.release(request_id, finished)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: DeltaSink,
        *,
        priority: int = 0,
    ) -> None:
        """Send a request whose room ``reserve`` claimed; its deltas go to ``sink`` until
        ``release``, which the caller owes once it is done with the request."""
        self._sinks[request_id] = sink
        if self.error is not None:
            sink.put(_failed(request_id, self.error))
        else:
            self.client.send(AddRequest(request_id, list(prompt_token_ids), params, priority))

    def release(self, request_id: str, finished: bool) -> None:
        """Forget a request's sink and free its room; one not ``finished`` is aborted."""
        if self._sinks.pop(request_id, None) is None:
            return
        self._num_live -= 1
        if not finished:
            self.abort(request_id)

    def add_turn_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after the deltas of every callback's turns reached their sinks."""
        self._turn_hooks.append(hook)

    def abort(self, request_id: str) -> None:
        """Abort a request on the engine's next turn (unknown or finished ids are ignored)."""
        self._send(AbortRequest(request_id))

    def stop(self, request_id: str) -> None:
        """Finish a request with reason "stop" on the engine's next turn (its text reached a
        stop string), freeing its cache; unknown or finished ids are ignored."""
        self._send(StopRequest(request_id))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine loop (callers drain first; what is still live is aborted) and free
        the engine; idempotent."""
        if not self._stopped:
            self._stopped = True
            self.client.shutdown(timeout)

    def _send(self, command: EngineCommand) -> None:
        if self.error is None and not self._stopped:
            self.client.send(command)

    def _dispatch(self, turns: list[EngineCoreOutputs]) -> None:
        """The engine turns that arrived, on the event loop: each delta to its request's sink,
        then the hooks, once for all of them (a front end that fell behind detokenizes and
        writes several turns' tokens together)."""
        sinks = self._sinks
        for outputs in turns:
            if outputs.stats is not None:
                self.stats = outputs.stats
            for delta in outputs.deltas:
                sink = sinks.get(delta.request_id)
                if sink is not None:  # None: its caller already left
                    sink.put(delta)
            if outputs.failure is not None and self.error is None:
                logger.error("the engine stopped: %s", outputs.failure)
                self.error = outputs.failure
                for request_id, sink in list(sinks.items()):
                    sink.put(_failed(request_id, outputs.failure))
        for hook in self._turn_hooks:
            hook()


def _failed(request_id: str, reason: str) -> RequestDelta:
    return RequestDelta(request_id, [], 0, error=reason, engine_failed=True)
