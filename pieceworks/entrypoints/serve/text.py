"""``TextStream``: a choice's generated tokens as text deltas, with OpenAI's stop strings.

A thin layer over the engine's ``IncrementalDetokenizer`` (the one ``LLM.generate`` and
``LLM.stream`` use, so the server's text is the offline text): each push of new token ids yields
the text they complete, a character spread over several byte-level tokens appearing once it is
whole; with stop strings, text that could still be the start of one is held back, and the first
stop string found ends the choice with the text before it (the stop string itself is not
included, as in vLLM and OpenAI); the caller then aborts the engine request. Without a tokenizer
(presets have random weights and no vocabulary) the text is always empty and only the token ids
mean anything.
"""

from __future__ import annotations

from typing import Any

from pieceworks.engine.detokenizer import IncrementalDetokenizer


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
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids or [], skip_special_tokens, [s for s in stop or [] if s]
            )
            if tokenizer is not None
            else None
        )

    @property
    def stopped(self) -> bool:
        """A stop string was found: the choice is over."""
        return self.detokenizer is not None and self.detokenizer.stop_reason is not None

    @property
    def text(self) -> str:
        """The choice's text so far (cut before a stop string), sent or held back."""
        return self.detokenizer.text if self.detokenizer is not None else ""

    def push(self, new_token_ids: list[int], finished: bool) -> str:
        """Add tokens; return the text to send now (all that is left when ``finished``). Tokens
        after a stop string (several arrive at once with multi-step decode) are dropped from
        ``token_ids``."""
        self.token_ids.extend(new_token_ids)
        if self.detokenizer is None:
            return ""
        self.detokenizer.update(new_token_ids)
        if self.stopped:  # the tokens after the one that completed the stop string are past its end
            del self.token_ids[self.detokenizer.num_generated_tokens :]
        return self.detokenizer.take_delta(finished or self.stopped)
