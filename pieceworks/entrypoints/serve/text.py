"""``TextStream``: a choice's generated tokens as text deltas, with OpenAI's stop strings.

A thin layer over the engine's ``IncrementalDetokenizer`` (the one ``LLM.generate`` and
``LLM.stream`` use, so the server's text is the offline text): each push of new token ids yields
the text they complete, a character spread over several byte-level tokens appearing once it is
whole; with stop strings, text that could still be the start of one is held back, and the first
stop string found ends the choice with the text before it (the stop string itself is not
included, as in vLLM and OpenAI); the caller then aborts the engine request. Without a tokenizer
(presets have random weights and no vocabulary) the text is always empty and only the token ids
mean anything.

A server decodes in two halves: ``add`` takes a stream's tokens as its delta arrives, and a
``TextBatch`` (one per engine) runs ``update_batch`` over every stream that gained tokens once
the engine turn's deltas are all in (``AsyncLLMEngine.add_turn_hook``): one tokenizer call per
round for all streams, instead of two per stream per token. ``take`` then hands out the text.
What must run once the turn's text is in (a stream's writer) is ``defer``red to the batch too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from pieceworks.engine.detokenizer import IncrementalDetokenizer, update_batch


class TextStream:
    """Incremental text of one choice: ``push`` token ids, get the text delta to send."""

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | None = None,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.token_ids: list[int] = []
        self.unread: list[int] = []  # token ids added but not detokenized yet
        self.stopped = False  # a stop string was found: the choice is over
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids or [], skip_special_tokens, [s for s in stop or [] if s]
            )
            if tokenizer is not None
            else None
        )

    @property
    def text(self) -> str:
        """The choice's text so far (cut before a stop string), sent or held back."""
        return self.detokenizer.text if self.detokenizer is not None else ""

    def push(self, new_token_ids: list[int], finished: bool) -> str:
        """Add tokens; return the text to send now (all that is left when ``finished``). Tokens
        after a stop string (several arrive at once with multi-step decode) are dropped from
        ``token_ids``."""
        self.add(new_token_ids)
        update_streams([self])
        return self.take(finished)

    def add(self, new_token_ids: list[int]) -> None:
        """Take tokens in; their text comes with the next ``update_streams``."""
        self.token_ids.extend(new_token_ids)
        if self.detokenizer is not None:
            self.unread.extend(new_token_ids)

    def take(self, finished: bool) -> str:
        """The text to send now (all that is left when ``finished`` or stopped)."""
        if self.detokenizer is None:
            return ""
        return self.detokenizer.take_delta(finished or self.stopped)


def update_streams(streams: list[TextStream]) -> None:
    """Detokenize every stream's unread tokens together; a stopped stream drops the tokens after
    the one that completed its stop string (several arrive at once with multi-step decode)."""
    streams = [stream for stream in dict.fromkeys(streams) if stream.unread]  # each once
    detokenizers = [stream.detokenizer for stream in streams]
    update_batch(detokenizers, [stream.unread for stream in streams])  # type: ignore[arg-type]
    for stream, detokenizer in zip(streams, detokenizers):
        stream.unread = []
        if detokenizer is not None and detokenizer.stop_reason is not None:
            stream.stopped = True
            del stream.token_ids[detokenizer.num_generated_tokens :]


class TextBatch:
    """The streams of one engine that gained tokens in the current engine turn, detokenized
    together when the turn's deltas are all in; then the ``after`` callback of each one whose
    text reached a stop string runs, and then every ``defer``red callback (the writers of the
    streams that have something to send)."""

    _by_engine: weakref.WeakKeyDictionary[Any, TextBatch] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._pending: list[tuple[TextStream, Callable[[], None]]] = []
        self._deferred: list[Callable[[], None]] = []

    @classmethod
    def of(cls, engine: Any) -> TextBatch:
        """The batch of ``engine`` (an ``AsyncLLMEngine``), made and hooked on first use."""
        batch = cls._by_engine.get(engine)
        if batch is None:
            batch = cls._by_engine[engine] = TextBatch()
            engine.add_turn_hook(batch.flush)
        return batch

    def add(self, stream: TextStream, after: Callable[[], None]) -> None:
        """Detokenize ``stream`` at the end of this turn; call ``after`` if it then stopped."""
        self._pending.append((stream, after))

    def defer(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` at the end of this turn, after every stream's text and ``after``."""
        self._deferred.append(callback)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            update_streams([stream for stream, _ in pending])
            for stream, after in pending:
                if stream.stopped:
                    after()
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            for callback in deferred:
                callback()
