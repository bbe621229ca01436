"""One HTTP request's generation: its ``n`` choices on the async engine, as text deltas.

``Generation`` starts one engine request per choice (prompt and sampling parameters each), turns
their token deltas into text through a ``TextStream`` per choice (detokenized with every other
stream of the engine turn, ``TextBatch``), and records the timings the metrics report (time to
first token, the gap between tokens). ``stream_batches()`` yields the ``ChoiceDelta``s of all
choices that changed, one list per wake of its reader (at most one per engine turn; what piled
up while the reader was busy merged into one delta per choice); ``collect()`` waits for the
whole result. A streamed response's writer skips the wake
instead: its ``on_ready`` callback runs at the end of every engine turn that brought something
(``TextBatch.defer``) and ``take``s the deltas there. Either way a choice stopped by a stop
string is aborted in the engine at once, and leaving early (a client that went away) aborts
every choice still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pieceworks.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pieceworks.engine.messages import RequestDelta
from pieceworks.entrypoints.serve.errors import bad_request
from pieceworks.entrypoints.serve.metrics import ServerMetrics
from pieceworks.entrypoints.serve.text import TextBatch, TextStream
from pieceworks.sampling_params import SamplingParams


@dataclasses.dataclass
class ChoiceDelta:
    """What one choice gained: text, token ids, and its finish reason once it ends."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[Any] | None = None  # the engine's entries for ``token_ids``, when asked
    text_offset: int = 0  # where ``text`` starts in the choice's whole text
    prompt_logprobs: list[Any] | None = None  # per prompt token (the first None), first delta


@dataclasses.dataclass
class ChoiceResult:
    index: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None


@dataclasses.dataclass
class ChoiceSpec:
    """One choice to generate: its prompt and sampling parameters.

    ``prompt_index`` says which prompt of the request it continues (usage counts each prompt
    once, however many choices continue it). A ``prompt_only`` choice (``max_tokens`` 0) runs
    as an engine request of one token, which is dropped: it ends after the prefill with reason
    "length" and no text of its own (vLLM's way of serving ``echo`` with ``max_tokens`` 0)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0
    priority: int = 0  # the request's (vLLM's ``priority`` field)
    prompt_only: bool = False


class _Choice:
    """One choice's engine request as it runs: the engine's sink for its deltas (``put``, on
    the event loop), its text (detokenized with every other stream of the turn by the engine's
    ``TextBatch``) and what it has not handed to the response yet (``take``)."""

    def __init__(self, generation: Generation, index: int, spec: ChoiceSpec) -> None:
        self.generation, self.index, self.spec = generation, index, spec
        self.request_id = f"{generation.request_id}-{index}"
        params = spec.params
        self.text = TextStream(
            generation.tokenizer, list(params.stop), spec.prompt_token_ids,
            params.skip_special_tokens,
        )  # fmt: skip
        self.result = generation.results[index]
        # looked up once: ``put`` runs for every token of every stream
        self.observe_token_gap = generation.metrics.observe_token_gap
        self.text_batch_add = generation.text_batch.add
        self.after_stop_callback = self.after_stop
        self.pending: RequestDelta | None = None  # arrived, not taken yet
        self.first: RequestDelta | None = None  # the first delta (start checks it)
        self.num_taken_tokens = 0
        self.last_arrival = 0.0
        self.done = False  # its last delta was taken
        self.released = False
        self.stop_sent = False

    def put(self, delta: RequestDelta) -> None:
        text = self.text
        if self.done or text.stopped:  # tokens still in flight after a stop string
            return
        pending = self.pending
        if pending is not None and pending.finished:
            return  # nothing follows a request's end (an engine failure may still name it)
        if self.spec.prompt_only:
            delta = _without_tokens(delta)
        new_token_ids = delta.new_token_ids
        now = time.perf_counter()
        if self.first is None:
            self.first = delta
        elif new_token_ids:
            self.observe_token_gap(now - self.last_arrival, len(new_token_ids))
        self.last_arrival = now
        self.pending = delta if pending is None else pending.merge(delta)
        text.add(new_token_ids)
        if new_token_ids and text.detokenizer is not None:
            self.text_batch_add(text, self.after_stop_callback)
        # The reader runs after this turn's text is in: a woken task after this callback, a
        # stream's writer at the end of the turn (``TextBatch.defer``).
        self.generation.wake()

    def after_stop(self) -> None:
        """This turn's tokens completed a stop string: finish the engine request now."""
        if not self.stop_sent:
            self.stop_sent = True
            self.generation.engine.stop(self.request_id)

    def take(self) -> ChoiceDelta | None:
        """What arrived since the last take, as one choice delta (None when nothing to send)."""
        delta, self.pending = self.pending, None
        if delta is None:
            return None
        if delta.error is not None:  # the engine died under the request
            raise EngineDeadError(delta.error)
        text = self.text
        detokenizer = text.detokenizer  # ``text.take``, inlined: this runs per token and stream
        piece = detokenizer.take_delta(delta.finished or text.stopped) if detokenizer else ""
        token_ids = text.token_ids
        num_tokens = len(token_ids)
        new_token_ids = token_ids[self.num_taken_tokens :]  # none past a stop string
        self.generation.metrics.num_generated_tokens += num_tokens - self.num_taken_tokens
        self.num_taken_tokens = num_tokens
        finish_reason = "stop" if text.stopped else delta.finish_reason
        result = self.result
        offset = len(result.text)
        result.text += piece
        result.token_ids += new_token_ids
        if delta.logprobs is not None:
            result.logprobs = (result.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            result.prompt_logprobs = delta.prompt_logprobs
        if finish_reason is None and not piece and not new_token_ids:
            return None
        result.finish_reason = finish_reason
        if finish_reason is not None:
            self.done = True
            self.generation.num_running -= 1
            self.release()
        return ChoiceDelta(
            self.index, piece, new_token_ids, finish_reason, delta.logprobs, offset,
            delta.prompt_logprobs,
        )  # fmt: skip

    def release(self) -> None:
        """Give the engine request back (aborted unless it finished or a stop string ended it)."""
        if not self.released:
            self.released = True
            self.generation.engine.release(self.request_id, self.done or self.stop_sent)


class Generation:
    """The choices of one request, running on ``engine`` (room reserved by ``start``).

    Each choice's deltas reach it inside the engine's dispatch (``_Choice.put``); the reader
    (``stream``) wakes once per engine turn for all of them and takes everything that arrived
    since it last ran, one merged delta per choice: a reader that fell behind sends fewer,
    larger chunks.
    """

    def __init__(
        self,
        engine: AsyncLLMEngine,
        choices: list[ChoiceSpec],
        tokenizer: Any,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.choices = choices
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.request_id = random_request_id()
        self.text_batch = TextBatch.of(engine)
        prompts = {choice.prompt_index: choice.prompt_token_ids for choice in choices}
        self.num_prompt_tokens = sum(len(ids) for ids in prompts.values())
        self.results = [
            ChoiceResult(index, choice.prompt_token_ids) for index, choice in enumerate(choices)
        ]
        self._choices: list[_Choice] = []
        self.num_running = 0  # choices whose last delta was not taken yet
        self._waiter: asyncio.Future[None] | None = None
        self._woken = False  # something arrived that the reader has not taken yet
        # A writer that takes the deltas itself, at the end of each engine turn that brought
        # some (instead of a reader woken through ``_waiter``); set once ``start`` returned.
        self.on_ready: Callable[[], None] | None = None

    def wake(self) -> None:
        """Something arrived for a choice: the reader runs (once, however many arrive); with
        ``on_ready`` set, it is called at the end of this engine turn (once)."""
        if self.on_ready is not None:
            if not self._woken:
                self._woken = True
                self.text_batch.defer(self.on_ready)
            return
        self._woken = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._woken:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._woken = False

    async def start(self) -> None:
        """Queue every choice and wait for each one's first delta (its first token, or the
        engine's refusal, which becomes a 400 before any response is sent)."""
        self.engine.reserve(len(self.choices))  # QueueFullError when the engine is full
        self.arrival = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        self._choices = [_Choice(self, i, spec) for i, spec in enumerate(self.choices)]
        self.num_running = len(self._choices)  # choices whose last delta was not taken yet
        try:
            for choice in self._choices:
                self.engine.add_request(
                    choice.request_id, choice.spec.prompt_token_ids, choice.spec.params, choice,
                    priority=choice.spec.priority,
                )  # fmt: skip
            while any(choice.first is None for choice in self._choices):
                await self._wait()
        except BaseException:
            await self.close()
            raise
        self._woken = True  # the first deltas are there to take
        firsts = [choice.first for choice in self._choices]
        failed = [delta.error for delta in firsts if delta is not None and delta.engine_failed]
        if failed:
            await self.close()
            raise EngineDeadError(failed[0])
        refused = [delta.error for delta in firsts if delta is not None and delta.error]
        if refused:
            await self.close()
            # the engine refuses a prompt (its ids, length, capacity) or a priority: the
            # scheduling policy's message names "priority=", the type check starts with it
            priority = refused[0].startswith("priority") or "has priority=" in refused[0]
            param = "priority" if priority else "prompt"
            raise bad_request(refused[0], param=param)
        self.metrics.observe_first_token(time.perf_counter() - self.arrival)

    async def stream_batches(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Every choice's deltas, a list per wake (one engine turn, or all the turns the reader
        missed); closing the iterator aborts what still runs."""
        try:
            while self.num_running:
                await self._wait()
                deltas = self.take()
                if deltas:
                    yield deltas
        finally:
            await self.close()

    def take(self) -> list[ChoiceDelta]:
        """Every choice's delta since the last take (none when nothing is to be sent)."""
        self._woken = False
        choices = self._choices
        if len(choices) == 1:
            delta = choices[0].take()
            return [delta] if delta is not None else []
        return [delta for choice in choices if (delta := choice.take())]

    async def collect(self) -> list[ChoiceResult]:
        """Wait for every choice to finish."""
        async for _ in self.stream_batches():
            pass
        return self.results

    async def close(self) -> None:
        """Give back every choice's engine request; one still running is aborted."""
        for choice in self._choices:
            choice.release()

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(result.token_ids) for result in self.results)


def random_request_id() -> str:
    """``uuid.uuid4().hex``, from the same random bits, without building a ``UUID``."""
    value = int.from_bytes(os.urandom(16), "big")
    value = value & ~(0xC000 << 48) | 0x8000 << 48  # the RFC 4122 variant
    value = value & ~(0xF000 << 64) | 4 << 76  # version 4
    return f"{value:032x}"


def _without_tokens(delta: RequestDelta) -> RequestDelta:
    """A prompt-only choice's delta: its one generated token dropped, its end ("length") kept."""
    logprobs: list[Any] | None = [] if delta.logprobs is not None else None
    # The dropped token may be EOS or a stop token: the choice still ends for its length, 0.
    reason = "length" if delta.finish_reason == "stop" else delta.finish_reason
    return dataclasses.replace(
        delta, new_token_ids=[], num_output_tokens=0, logprobs=logprobs, finish_reason=reason
    )
