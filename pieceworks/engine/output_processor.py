"""``OutputProcessor``: engine steps turned into text, streaming deltas and vLLM-shaped outputs.

It sits between a caller's loop and ``EngineCore``: ``add_request`` queues a prompt as ``n``
engine requests (one per completion), ``step`` runs one engine step and returns a
``CompletionDelta`` for every completion that got new tokens or text (or finished), and
``get_output`` builds the cumulative ``RequestOutput`` (text, token ids, logprobs, prompt
logprobs). Each completion has an ``IncrementalDetokenizer``; when its text reaches a stop string
the processor finishes the engine request at once (``EngineCore.stop_request``), so its KV blocks
free on that step. ``LLM.generate``, ``LLM.stream`` and the chat command run this loop; a server
runs the same loop and routes the deltas to its clients by ``request_id``.

Completion ``i`` of a prompt with ``n > 1`` and a ``seed`` samples with seed ``seed + i``;
``prompt_logprobs`` are computed once, by completion 0.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from pieceworks.engine.core import EngineCore
from pieceworks.engine.detokenizer import IncrementalDetokenizer
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.request import Request, TokenLogprob


@dataclasses.dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability, its rank in the vocabulary (1 is the most
    likely) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, the top-k and the chosen token (vLLM's layout).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM's: ``text`` (None without a tokenizer) is cut before
    a stop string; ``logprobs`` has one dict per token when ``SamplingParams.logprobs`` is set."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None = None  # the stop string (or stop token id) that ended it


@dataclasses.dataclass
class RequestOutput:
    """A prompt's result: its completions and, when asked, its prompt's logprobs (first None)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool


@dataclasses.dataclass(frozen=True)
class CompletionDelta:
    """What one completion gained in a step: new token ids and new text ("" without a
    tokenizer, or while text is held back); ``finish_reason`` is set on its last delta."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


class _Completion:
    """One engine request (one completion) and the text and stream position built from it."""

    def __init__(self, request: Request, index: int, parent_id: str, tokenizer: Any) -> None:
        self.request, self.index, self.parent_id = request, index, parent_id
        params = request.sampling_params
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.stop
            )
            if tokenizer is not None
            else None
        )
        self.num_seen_tokens = 0
        self.reported_finish = False

    @property
    def finished(self) -> bool:
        return self.request.is_finished

    @property
    def finish_reason(self) -> str | None:
        if self.detokenizer is not None and self.detokenizer.stop_reason is not None:
            return "stop"  # a stop string ends the text even on the step max_tokens is reached
        return self.request.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        if self.detokenizer is not None and self.detokenizer.stop_reason is not None:
            return self.detokenizer.stop_reason
        last = self.request.output_token_ids[-1] if self.request.output_token_ids else None
        if (
            self.request.finish_reason == "stop"
            and last in self.request.sampling_params.stop_token_ids
        ):
            return last
        return None

    def advance(self, engine: EngineCore) -> CompletionDelta | None:
        """Read the request's new tokens, detokenize them, stop it on a stop string (dropping
        the tokens after the one that completed it: a multi-step run samples several at once)."""
        new_token_ids = self.request.output_token_ids[self.num_seen_tokens :]
        text = ""
        if self.detokenizer is not None:
            if self.detokenizer.update(new_token_ids) is not None:
                num_kept = self.detokenizer.num_generated_tokens
                if num_kept < self.request.num_output_tokens:
                    self.request.drop_output_after(num_kept)
                    new_token_ids = new_token_ids[: num_kept - self.num_seen_tokens]
                if not self.finished:
                    engine.stop_request(self.request.request_id)
            text = self.detokenizer.take_delta(self.finished)
        self.num_seen_tokens += len(new_token_ids)
        if self.finished and not self.reported_finish:
            self.reported_finish = True
            return CompletionDelta(
                self.parent_id, self.index, new_token_ids, text, self.finish_reason
            )
        if not new_token_ids and not text:
            return None
        return CompletionDelta(self.parent_id, self.index, new_token_ids, text)


@dataclasses.dataclass
class _Prompt:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]


class OutputProcessor:
    """Requests in, text out: see the module docstring for the loop it runs."""

    def __init__(self, engine: EngineCore, tokenizer: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._prompts: dict[str, _Prompt] = {}
        # Completions whose finish was not reported yet, by engine request id (queue order), and
        # those among them with stop strings, whose text must be checked every step.
        self._live: dict[str, _Completion] = {}
        self._with_stop: dict[str, _Completion] = {}
        self._request_ids = itertools.count()
        self._decoded_tokens: dict[int, str] = {}

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue ``params.n`` completions of a prompt; returns the id its outputs carry."""
        request_id = request_id if request_id is not None else f"pw-{next(self._request_ids)}"
        if request_id in self._prompts:
            raise ValueError(f"request id {request_id!r} is in use; give each request its own")
        completions = []
        for index in range(params.n):
            request = self.engine.add_request(
                list(prompt_token_ids),
                _completion_params(params, index),
                request_id=request_id if params.n == 1 else f"{request_id}-{index}",
                priority=priority,
            )
            completions.append(_Completion(request, index, request_id, self.tokenizer))
        self._prompts[request_id] = _Prompt(prompt, list(prompt_token_ids), params, completions)
        for completion in completions:
            self._live[completion.request.request_id] = completion
            if params.stop and self.tokenizer is not None:
                self._with_stop[completion.request.request_id] = completion
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self._live) or self.engine.has_unfinished_requests()

    def step(self, stream: bool = True) -> list[CompletionDelta]:
        """One engine step; the deltas of every completion that changed, in queue order.

        ``stream=False`` (``LLM.generate``) skips the per-step work for completions that need
        none: only those with stop strings and those the step finished are brought up to date,
        so a step costs the host nothing per running request. ``get_output`` catches up the rest.
        """
        engine_busy = self.engine.has_unfinished_requests()
        finished = self.engine.step() if engine_busy else []
        if stream or not engine_busy:  # idle engine: whatever is live finished, report it
            candidates = list(self._live.values())
        else:
            ids = [r.request_id for r in finished if r.request_id not in self._with_stop]
            candidates = [
                *self._with_stop.values(),
                *(self._live[i] for i in ids if i in self._live),
            ]
        deltas = [delta for c in candidates if (delta := c.advance(self.engine)) is not None]
        for completion in candidates:
            if completion.reported_finish:
                self._forget(completion)
        return deltas

    def abort_request(self, request_id: str) -> None:
        """Abort every unfinished completion of a prompt (a client went away) and forget it."""
        for completion in self._prompts.pop(request_id).completions:
            self.engine.abort_request(completion.request.request_id)
            self._forget(completion)

    def _forget(self, completion: _Completion) -> None:
        self._live.pop(completion.request.request_id, None)
        self._with_stop.pop(completion.request.request_id, None)

    def get_output(self, request_id: str, forget: bool = False) -> RequestOutput:
        """The prompt's cumulative output now; ``forget`` drops it (call once it finished)."""
        state = self._prompts.pop(request_id) if forget else self._prompts[request_id]
        for completion in state.completions:
            if not completion.reported_finish:
                completion.advance(self.engine)  # catch up what step(stream=False) skipped
                if completion.reported_finish:
                    self._forget(completion)
        outputs = [self._completion_output(c) for c in state.completions]
        prompt_logprobs = None
        if state.params.prompt_logprobs is not None:
            first = state.completions[0].request
            prompt_logprobs = [self._position(entry) for entry in first.prompt_logprobs]
        finished = all(c.finished for c in state.completions)
        return RequestOutput(
            request_id, state.prompt, state.prompt_token_ids, prompt_logprobs, outputs, finished
        )

    def _completion_output(self, completion: _Completion) -> CompletionOutput:
        request = completion.request
        logprobs = cumulative = None
        if request.sampling_params.logprobs is not None:
            logprobs = [self._position(entry) or {} for entry in request.output_logprobs]
            cumulative = sum(entry.logprob for entry in request.output_logprobs)
        detokenizer = completion.detokenizer
        return CompletionOutput(
            completion.index,
            detokenizer.text if detokenizer is not None else None,
            list(request.output_token_ids),
            cumulative,
            logprobs,
            completion.finish_reason,
            completion.stop_reason,
        )

    def _position(self, entry: TokenLogprob | None) -> PositionLogprobs | None:
        """vLLM's dict for one position: the top-k (rank = place) and the chosen token."""
        if entry is None:
            return None
        position = {
            token_id: Logprob(logprob, rank, self._decoded(token_id))
            for rank, (token_id, logprob) in enumerate(
                zip(entry.top_ids, entry.top_logprobs), start=1
            )
        }
        if entry.token_id not in position:
            position[entry.token_id] = Logprob(
                entry.logprob, entry.rank, self._decoded(entry.token_id)
            )
        return position

    def _decoded(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        if token_id not in self._decoded_tokens:
            self._decoded_tokens[token_id] = self.tokenizer.decode([token_id])
        return self._decoded_tokens[token_id]


def _completion_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index``'s own parameters: one completion each, seed ``seed + index``, and
    prompt logprobs only on completion 0 (they are the same for all)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
