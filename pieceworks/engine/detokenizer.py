"""``IncrementalDetokenizer``: a request's text, grown token by token, and its stop strings.

Decoding each new token on its own gets text wrong: byte-level BPE splits one character over
several tokens (an emoji, most CJK), and SentencePiece tokenizers drop a leading space when a
token is decoded without its left neighbour. vLLM's answer, used here: keep two offsets into the
token ids, ``prefix_offset`` (start of a few tokens of left context) and ``read_offset`` (end of
the text already emitted). Each new token decodes ``ids[prefix_offset:read_offset]`` and
``ids[prefix_offset:]``; the difference of the two strings is the new text, emitted only once it
no longer ends in the replacement character U+FFFD (a character still incomplete). The context
starts with the prompt's last tokens, so the first generated token gets its leading space right.

The detokenizer also owns the ``stop`` strings (``SamplingParams.stop``): each update searches the
new text (and the few characters before it a stop string could straddle, so a stop string split
over several tokens is found) and cuts the text before the first match. ``take_delta`` hands out
text not yet streamed, holding back the last ``len(longest stop) - 1`` characters until the
request finishes: they could still turn out to be the start of a stop string, and streamed text
is never taken back. The engine, not this class, finishes a request whose text stopped.

``update_batch`` advances many detokenizers at once, as a server does with every stream's tokens
of one engine step: each round decodes one new token of every detokenizer in one batch
(``batch_decoder``: the Rust tokenizer's own ``decode`` per sequence for a transformers fast
tokenizer, which skips transformers' per-call Python; its ``decode`` for any other). The text is
the same as token-by-token ``update`` calls give.

Byte-level BPE tokenizers (GPT-2's decoder: SmolLM2, Llama 3, Qwen) decode a run of tokens by
joining their bytes and reading them as UTF-8. Once the text ends on a complete character, a
regular vocabulary token whose own bytes are whole UTF-8 characters adds exactly its own text,
so the two decodes give ``prefix + token_text``. ``token_texts`` decodes every vocabulary token
alone once per tokenizer, and most tokens take their text from it instead of two decodes; added
and special tokens, tokens holding part of a character, the first generated token and the first
after a held-back one take vLLM's step above, so the text is the same.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Prompt tokens kept as left context for the first generated token (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_CONTEXT_TOKENS = 5
# Token ids before ``prefix_offset`` are dropped once this many pile up (they are never decoded
# again), so a long generation does not keep its whole id list twice.
MAX_DEAD_TOKENS = 64
REPLACEMENT_CHARACTER = "\ufffd"
# transformers' fast-tokenizer decode methods, which only call the Rust tokenizer's ``decode`` (and
# clean up spaces, which the detokenizer turns off): a subclass that overrides them is not bypassed.
_PLAIN_DECODE = {"PreTrainedTokenizerBase.decode"}
_PLAIN_BACKEND_DECODE = {"TokenizersBackend._decode", "PreTrainedTokenizerFast._decode"}

BatchDecoder = Callable[[list[list[int]], bool], list[str]]


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer under a transformers fast tokenizer whose decode only calls it, else
    None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    plain = (
        getattr(getattr(cls, "decode", None), "__qualname__", "") in _PLAIN_DECODE
        and getattr(getattr(cls, "_decode", None), "__qualname__", "") in _PLAIN_BACKEND_DECODE
    )
    return backend if plain and hasattr(backend, "decode") else None


def batch_decoder(tokenizer: Any) -> BatchDecoder:
    """``decode(sequences, skip_special_tokens)``: each sequence's text, as
    ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        # One Rust ``decode`` per sequence: the Rust ``decode_batch`` hands a turn's short
        # sequences to its thread pool, whose threads cost more CPU (and no less time) than the
        # decoding they share.
        decode = backend.decode
        return lambda sequences, skip: [decode(ids, skip_special_tokens=skip) for ids in sequences]

    def decode_each(sequences: list[list[int]], skip: bool) -> list[str]:
        return [
            tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            for ids in sequences
        ]

    return decode_each


def token_texts(tokenizer: Any) -> list[str | None] | None:
    """For a byte-level BPE tokenizer, each vocabulary token's text after text that ends on a
    complete character (its own decode), or None where that does not hold (added and special
    tokens, bytes that are not whole characters). None for any other tokenizer, whose decoder
    may not join tokens' texts (SentencePiece drops a leading space)."""
    backend = _plain_backend(tokenizer)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    added = set(backend.get_added_tokens_decoder())
    vocab_size = backend.get_vocab_size(with_added_tokens=False)
    texts = backend.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    return [
        None if (i in added or not text or REPLACEMENT_CHARACTER in text) else text
        for i, text in enumerate(texts)
    ]


@dataclass(frozen=True)
class _Decoding:
    """What a tokenizer's detokenizers share: the batch decoder and the tokens' texts."""

    decode_batch: BatchDecoder
    token_texts: list[str | None] | None


_DECODINGS: weakref.WeakKeyDictionary[Any, _Decoding] = weakref.WeakKeyDictionary()


def prepare_decoding(tokenizer: Any) -> _Decoding:
    """The tokenizer's ``_Decoding``, built once per tokenizer (about 30 ms for 49k tokens; a
    server calls this at start-up, not on its first request), per request where the tokenizer
    cannot be weakly referenced."""
    try:
        return _DECODINGS[tokenizer]
    except (KeyError, TypeError):
        pass
    decoding = _Decoding(batch_decoder(tokenizer), token_texts(tokenizer))
    try:
        _DECODINGS[tokenizer] = decoding
    except TypeError:
        pass
    return decoding


class IncrementalDetokenizer:
    """Text of one request's generated tokens, decoded as they arrive; finds stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        decoding = prepare_decoding(tokenizer)
        self.decode_batch = decoding.decode_batch
        self.token_texts = decoding.token_texts
        self.skip_special_tokens = skip_special_tokens
        # what ``update_batch`` decodes together: one tokenizer, one ``skip_special_tokens``
        self.batch_key = (id(tokenizer), skip_special_tokens)
        self.stop = tuple(stop)
        self.stop_buffer_length = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])  # context + generated
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.stop_reason: str | None = None  # the stop string that ended the text
        # Generated tokens taken in: after a stop, the count up to the one that completed it.
        self.num_generated_tokens = 0
        self.num_streamed_chars = 0
        # The last token taken in completed its text (unknown for the prompt's context): the
        # next token's text may then come from ``token_texts``.
        self.complete = False

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Add generated tokens; return the stop string the text now contains (once), else None.

        After a stop string is found further tokens (one may already be in flight) are ignored.
        """
        return update_batch([self], [new_token_ids])[0]

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; while unfinished, minus the tail a stop string could start."""
        end = len(self.text)
        if not finished and self.stop_reason is None:
            end -= self.stop_buffer_length
        if end <= self.num_streamed_chars:
            return ""
        delta = self.text[self.num_streamed_chars : end]
        self.num_streamed_chars = end
        return delta

    def _append(self, token_id: int) -> tuple[list[int], list[int]]:
        """Take in one generated token; the two id runs vLLM's step decodes for it."""
        self.token_ids.append(token_id)
        self.num_generated_tokens += 1
        ids = self.token_ids
        return ids[self.prefix_offset : self.read_offset], ids[self.prefix_offset :]

    def _known_text(self, token_id: int) -> str | None:
        """Take in ``token_id`` if its text is known without decoding; that text, else None."""
        texts = self.token_texts
        if not self.complete or texts is None or not 0 <= token_id < len(texts):
            return None
        text = texts[token_id]
        if text is not None:
            self.token_ids.append(token_id)
            self.num_generated_tokens += 1
        return text

    def _advance(self, prefix_text: str, full_text: str) -> str | None:
        """vLLM's prefix/read-offset step: the newest token's text from its two decoded runs
        (none while a character is incomplete); the stop string it completed, else None."""
        num_prefix_chars = len(prefix_text)
        if len(full_text) <= num_prefix_chars or full_text.endswith(REPLACEMENT_CHARACTER):
            self.complete = False
            return None  # an incomplete character (or a skipped special token): wait for more
        return self._emit(full_text[num_prefix_chars:])

    def _emit(self, new_text: str) -> str | None:
        """Add the newest token's text, which completes every token before it; the stop string
        it completed, else None."""
        self.complete = True
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if self.prefix_offset > MAX_DEAD_TOKENS:
            del self.token_ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        self.text += new_text
        if self.stop and self._find_stop(len(new_text)):
            return self.stop_reason
        return None

    def _find_stop(self, num_new_chars: int) -> bool:
        """Cut the text before the earliest stop string in its new part (plus the characters a
        stop string could reach back into); True if one was found."""
        if not self.stop:
            return False
        search_start = max(len(self.text) - num_new_chars - self.stop_buffer_length, 0)
        matches = [
            (index, stop)
            for stop in self.stop
            if (index := self.text.find(stop, search_start)) >= 0
        ]
        if not matches:
            return False
        index, self.stop_reason = min(matches)
        self.text = self.text[:index]
        return True


def update_batch(
    detokenizers: Sequence[IncrementalDetokenizer], new_token_ids: Sequence[Sequence[int]]
) -> list[str | None]:
    """``detokenizer.update(ids)`` for each pair, decoding together: each round takes a token of
    every detokenizer that has one left, looks up the texts ``token_texts`` holds and decodes the
    rest in one batch per ``skip_special_tokens`` value."""
    stops: list[str | None] = [None] * len(detokenizers)
    queues = [
        list(ids) if d.stop_reason is None else [] for d, ids in zip(detokenizers, new_token_ids)
    ]

    def stopped(i: int, stop: str | None) -> None:
        if stop is not None:
            stops[i] = stop
            queues[i].clear()  # tokens after the stop are never taken in

    active = [i for i, queue in enumerate(queues) if queue]
    while active:
        groups: dict[tuple[int, bool], list[int]] = {}
        for i in active:
            detokenizer = detokenizers[i]
            text = detokenizer._known_text(queues[i][0])
            if text is None:
                groups.setdefault(detokenizer.batch_key, []).append(i)
                continue
            queues[i].pop(0)
            stopped(i, detokenizer._emit(text))
        for (_, skip), members in groups.items():
            runs = [run for i in members for run in detokenizers[i]._append(queues[i].pop(0))]
            texts = detokenizers[members[0]].decode_batch(runs, skip)
            for position, i in enumerate(members):
                stopped(i, detokenizers[i]._advance(texts[2 * position], texts[2 * position + 1]))
        active = [i for i in active if queues[i]]
    return stops
