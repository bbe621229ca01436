"""One HTTP request's generation: its ``n`` choices on the async engine, as text deltas.

``Generation`` starts one engine request per choice (prompt and sampling parameters each), turns
their token deltas into text through a ``TextStream`` per choice, and records the timings the
metrics report (time to first token, the gap between tokens). ``stream()`` yields
``ChoiceDelta``s of all choices as they arrive; ``collect()`` waits for the whole result. Either
way a choice stopped by a stop string is aborted in the engine at once, and leaving early
(a client that went away) aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pieceworks.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pieceworks.engine.messages import RequestDelta
from pieceworks.entrypoints.serve.errors import bad_request
from pieceworks.entrypoints.serve.metrics import ServerMetrics
from pieceworks.entrypoints.serve.text import TextStream
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


class Generation:
    """The choices of one request, running on ``engine`` (room reserved by ``start``)."""

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
        self.request_id = uuid.uuid4().hex
        prompts = {choice.prompt_index: choice.prompt_token_ids for choice in choices}
        self.num_prompt_tokens = sum(len(ids) for ids in prompts.values())
        self.results = [
            ChoiceResult(index, choice.prompt_token_ids) for index, choice in enumerate(choices)
        ]
        self._pending: list[AsyncIterator[RequestDelta]] = []
        self._firsts: list[RequestDelta] = []

    async def start(self) -> None:
        """Queue every choice and wait for each one's first delta (its first token, or the
        engine's refusal, which becomes a 400 before any response is sent)."""
        self.engine.reserve(len(self.choices))  # QueueFullError when the engine is full
        self.arrival = time.perf_counter()
        self._pending = [
            self.engine.generate(
                choice.prompt_token_ids,
                choice.params,
                f"{self.request_id}-{i}",
                reserved=True,
                priority=choice.priority,
            )
            for i, choice in enumerate(self.choices)
        ]
        try:
            self._firsts = list(await asyncio.gather(*(anext(g) for g in self._pending)))
        except BaseException:
            await self.close()
            raise
        failed = [delta.error for delta in self._firsts if delta.engine_failed]
        if failed:
            await self.close()
            raise EngineDeadError(failed[0])
        refused = [delta.error for delta in self._firsts if delta.error is not None]
        if refused:
            await self.close()
            # the engine refuses a prompt (its ids, length, capacity) or a priority: the
            # scheduling policy's message names "priority=", the type check starts with it
            priority = refused[0].startswith("priority") or "has priority=" in refused[0]
            param = "priority" if priority else "prompt"
            raise bad_request(refused[0], param=param)
        self.metrics.observe_first_token(time.perf_counter() - self.arrival)

    async def stream(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas as they come; closing the iterator aborts what still runs."""
        merged: asyncio.Queue[ChoiceDelta | None] = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(self._pump(index, merged)) for index in range(len(self.choices))
        ]
        try:
            for _ in range(len(tasks)):
                while (delta := await merged.get()) is not None:
                    yield delta
            for task in tasks:  # a choice whose engine stream failed fails the request
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()

    async def collect(self) -> list[ChoiceResult]:
        """Wait for every choice to finish."""
        async for _ in self.stream():
            pass
        return self.results

    async def _pump(self, index: int, merged: asyncio.Queue[ChoiceDelta | None]) -> None:
        """Turn choice ``index``'s engine deltas into text deltas on ``merged``; None when done."""
        spec = self.choices[index]
        params = spec.params
        text = TextStream(
            self.tokenizer, list(params.stop), spec.prompt_token_ids, params.skip_special_tokens
        )
        result, deltas = self.results[index], self._pending[index]
        last = self.arrival
        delta: RequestDelta | None = self._firsts[index]
        try:
            while delta is not None:
                now = time.perf_counter()
                if delta.new_token_ids and delta is not self._firsts[index]:
                    self.metrics.observe_token_gap(now - last, len(delta.new_token_ids))
                last = now
                if spec.prompt_only:
                    delta = _without_tokens(delta)
                choice = self._choice_delta(index, delta, text, result)
                if choice is not None:
                    await merged.put(choice)
                if choice is not None and choice.finish_reason is not None:
                    break
                delta = await anext(deltas, None)
            if text.stopped:  # a stop string: finish the engine request now
                self.engine.stop(f"{self.request_id}-{index}")
            await deltas.aclose()  # type: ignore[attr-defined]
        finally:
            await merged.put(None)

    def _choice_delta(
        self, index: int, delta: RequestDelta, text: TextStream, result: ChoiceResult
    ) -> ChoiceDelta | None:
        if delta.error is not None:  # the engine died under the request
            raise EngineDeadError(delta.error)
        num_tokens_before = len(text.token_ids)
        piece = text.push(delta.new_token_ids, delta.finished)
        new_token_ids = text.token_ids[num_tokens_before:]  # none past a stop string
        self.metrics.add_generated_tokens(len(new_token_ids))
        finish_reason = "stop" if text.stopped else delta.finish_reason
        offset = len(result.text)
        result.text += piece
        result.token_ids.extend(new_token_ids)
        if delta.logprobs is not None:
            result.logprobs = (result.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            result.prompt_logprobs = delta.prompt_logprobs
        if finish_reason is None and not piece and not new_token_ids:
            return None
        result.finish_reason = finish_reason
        return ChoiceDelta(
            index,
            piece,
            new_token_ids,
            finish_reason,
            delta.logprobs,
            offset,
            delta.prompt_logprobs,
        )

    async def close(self) -> None:
        """Close every choice's engine stream; one still running is aborted."""
        for deltas in self._pending:
            await deltas.aclose()  # type: ignore[attr-defined]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(result.token_ids) for result in self.results)


def _without_tokens(delta: RequestDelta) -> RequestDelta:
    """A prompt-only choice's delta: its one generated token dropped, its end ("length") kept."""
    logprobs: list[Any] | None = [] if delta.logprobs is not None else None
    # The dropped token may be EOS or a stop token: the choice still ends for its length, 0.
    reason = "length" if delta.finish_reason == "stop" else delta.finish_reason
    return dataclasses.replace(
        delta, new_token_ids=[], num_output_tokens=0, logprobs=logprobs, finish_reason=reason
    )
