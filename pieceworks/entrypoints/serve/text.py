"""``TextStream``: a choice's generated tokens as text deltas, with OpenAI's stop strings.

Each push of new token ids yields the text they add. Text is decoded from all the tokens so far
and diffed against what was already sent, so a character spread over several byte-level tokens
appears once it is complete (a trailing U+FFFD is held back until the next token settles it).
With stop strings, text that could still be the start of one is held back too, and the first
stop string found ends the choice: the text before it is the output (the stop string itself is
not included, as in vLLM and OpenAI), and the caller aborts the engine request. Without a
tokenizer (presets have random weights and no vocabulary) the text is always empty and only the
token ids mean anything.
"""

from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class TextStream:
    """Incremental text of one choice: ``push`` token ids, get the text delta to send."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # the text sent so far
        self.stopped = False  # a stop string was found: the choice is over

    def push(self, new_token_ids: list[int], finished: bool) -> str:
        """Add tokens; return the text to send now (all that is left when ``finished``)."""
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None or self.stopped:
            return ""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self.stop:
            found = self._find_stop(full)
            if found is not None:
                self.stopped = True
                return self._advance(full[:found])
        if not finished:
            full = full.rstrip(_INCOMPLETE) if full.endswith(_INCOMPLETE) else full
            if self.stop and self.hold_back:
                full = full[: max(len(full) - self.hold_back, len(self.text))]
        return self._advance(full)

    def _find_stop(self, full: str) -> int | None:
        """Index where the earliest stop string starts in the unsent tail, if any."""
        start = max(len(self.text) - self.hold_back, 0)
        hits = [index for s in self.stop if (index := full.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _advance(self, text: str) -> str:
        if not text.startswith(self.text):  # a decoder revised earlier text: send nothing more
            return ""
        delta = text[len(self.text) :]
        self.text = text
        return delta
