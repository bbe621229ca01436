"""``TextStream``: streamed text deltas add up to the decoded text; stop strings cut it.

Proves, with a byte-level fake tokenizer (one token per UTF-8 byte): a character split over
several tokens is sent once complete; the concatenated deltas equal the final text; text that
could still begin a stop string is held back until it cannot; the first stop string ends the
choice with the text before it (even when split over tokens), and tokens pushed after the one
that completed it are dropped; without a tokenizer no text is sent.
Run: pytest tests/entrypoints/test_serve_text.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from pieceworks.entrypoints.serve.text import TextStream  # noqa: E402


class ByteTokenizer:
    """Token i is byte i; decoding replaces an incomplete UTF-8 sequence with U+FFFD."""

    def decode(self, ids: list[int], **options) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def stream_all(stream: TextStream, tokens: list[int]) -> list[str]:
    deltas = [stream.push([token], finished=False) for token in tokens[:-1]]
    return deltas + [stream.push(tokens[-1:], finished=True)]


def test_split_character_is_sent_once_complete():
    stream = TextStream(ByteTokenizer())
    tokens = ids("a€b")  # the euro sign is three bytes
    deltas = stream_all(stream, tokens)
    assert deltas == ["a", "", "", "€", "b"]
    assert "".join(deltas) == stream.text == "a€b"


def test_stop_string_cuts_the_text_and_holds_back_its_prefix():
    stream = TextStream(ByteTokenizer(), stop=["STOP"])
    deltas = [stream.push([token], finished=False) for token in ids("abcST")]
    assert "".join(deltas) == "ab"  # "cST" could still begin "STOP"
    assert not stream.stopped
    rest = [stream.push([token], finished=False) for token in ids("OPxyz")]
    assert stream.stopped and "".join(deltas + rest) == stream.text == "abc"
    assert stream.push(ids("more"), finished=True) == ""  # after the stop nothing more is sent


def test_tokens_after_a_stop_string_in_one_push_are_dropped():
    """Multi-step decode delivers several tokens at once: those after the one that completed the
    stop string are not the choice's."""
    stream = TextStream(ByteTokenizer(), stop=["STOP"])
    assert stream.push(ids("ab"), finished=False) == ""  # held back: it could begin "STOP"
    assert stream.push(ids("cSTOPxy"), finished=False) == "abc"
    assert stream.stopped and stream.text == "abc"
    assert stream.token_ids == ids("abcSTOP")


def test_a_false_start_is_released():
    stream = TextStream(ByteTokenizer(), stop=["STOP"])
    deltas = stream_all(stream, ids("aSTOxSTb"))
    assert not stream.stopped
    assert "".join(deltas) == "aSTOxSTb"


def test_no_tokenizer_sends_no_text():
    stream = TextStream(None, stop=["x"])
    assert stream.push([1, 2, 3], finished=True) == ""
    assert stream.token_ids == [1, 2, 3]
