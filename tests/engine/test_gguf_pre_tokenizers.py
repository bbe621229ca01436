"""How a GGUF byte-level BPE vocabulary splits text, for every ``tokenizer.ggml.pre`` value the
tokenizer knows, on hand-written metadata (no file is read, nothing is downloaded).

Proves: each name of the GPT-2 family (and a vocabulary without the key) splits as GPT-2's regex,
each of the "digits, then GPT-2" family as that with every digit alone, each of the Llama 3
family as Meta's Llama 3 regex, with no prefix space; the pieces are those of the published
patterns applied with the ``regex`` module (GPT-2's ``encoder.py``, Llama 3's ``tokenizer.py``)
on a string of contractions, digit runs, whitespace runs, newlines, punctuation and non-ASCII
letters; the token ids then show each split (merges that cross a wrong boundary would apply);
an unknown name goes to transformers' converter.
Run: pytest tests/engine/test_gguf_pre_tokenizers.py
"""

from __future__ import annotations

import pytest

from pieceworks.engine import tokenizer as tokenizer_module
from pieceworks.engine.tokenizer import bytes_to_unicode, gguf_tokenizer

regex = pytest.importorskip("regex")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

# The published patterns, independent of the tokenizer module: GPT-2's (openai/gpt-2
# src/encoder.py) and Llama 3's (meta-llama/llama3 llama/tokenizer.py pat_str).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TRICKY = "I'm 2024's  big\tDAY!!\n\n  x ünï 🙂 WE'LL"
GPT2_PIECES = ["I", "'m", " 2024", "'s", " ", " big", "\t", "DAY", "!!", "\n\n ", " x", " ünï",
               " 🙂", " WE", "'", "LL"]  # fmt: skip
DIGITS_THEN_GPT2_PIECES = ["I", "'m", " ", "2", "0", "2", "4", *GPT2_PIECES[3:]]
LLAMA3_PIECES = ["I", "'m", " ", "202", "4", "'s", " ", " big", "\tDAY", "!!\n\n", " ", " x",
                 " ünï", " 🙂", " WE", "'LL"]  # fmt: skip

GPT2_NAMES = ["gpt2", "default", "gpt-2"]
DIGITS_THEN_GPT2_NAMES = ["smollm", "starcoder", "refact", "command-r", "codeshell"]
LLAMA3_NAMES = ["llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"]

TOKENS = ["<|endoftext|>", *bytes_to_unicode().values(), "Ġ2", "20", "'L", "ĊĠ"]
MERGES = ["Ġ 2", "2 0", "' L", "Ċ Ġ"]
TEXT = "I'm 2024  x!!\n\n  y WE'LL"


def metadata(pre: str | None) -> dict:
    """A byte-level BPE vocabulary: the byte alphabet and four merges that show the split."""
    entries = {"ggml.model": "gpt2", "ggml.tokens": TOKENS, "ggml.merges": MERGES}
    return entries if pre is None else {**entries, "ggml.pre": pre}


def build(monkeypatch, pre: str | None):
    """The tokenizer of ``metadata(pre)``; transformers' converter must not be reached."""
    from transformers import AutoTokenizer

    def no_converter(*args, **kwargs):
        raise AssertionError("a byte-level BPE vocabulary is built here, not by transformers")

    monkeypatch.setattr(tokenizer_module, "gguf_tokenizer_metadata", lambda path: metadata(pre))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_converter)
    return gguf_tokenizer("models/tiny.gguf")


def pieces(tokenizer, text: str) -> list[str]:
    """The pre-tokenizer's pieces of ``text``, spelled back from the byte alphabet."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    split = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    return [bytes(byte_of[char] for char in piece).decode() for piece, _ in split]


def token_ids(spelling: str) -> list[int]:
    return [TOKENS.index(token) for token in spelling.split(" ")]


def test_the_expected_pieces_are_those_of_the_published_patterns():
    assert regex.findall(GPT2_PATTERN, TRICKY) == GPT2_PIECES
    digit_runs = regex.findall(r"\p{N}|\P{N}+", TRICKY)  # every digit alone, then GPT-2's
    assert [p for run in digit_runs for p in regex.findall(GPT2_PATTERN, run)] == (
        DIGITS_THEN_GPT2_PIECES
    )
    assert regex.findall(LLAMA3_PATTERN, TRICKY) == LLAMA3_PIECES


@pytest.mark.parametrize("pre", [*GPT2_NAMES, None])
def test_the_gpt2_family_splits_as_gpt2(monkeypatch, pre):
    tokenizer = build(monkeypatch, pre)
    assert pieces(tokenizer, TRICKY) == GPT2_PIECES
    assert tokenizer.encode(TEXT) == token_ids("I ' m Ġ2 0 2 4 Ġ Ġ x ! ! Ċ ĊĠ Ġ y Ġ W E ' L L")


@pytest.mark.parametrize("pre", DIGITS_THEN_GPT2_NAMES)
def test_the_digits_family_splits_every_digit_then_as_gpt2(monkeypatch, pre):
    tokenizer = build(monkeypatch, pre)
    assert pieces(tokenizer, TRICKY) == DIGITS_THEN_GPT2_PIECES
    # "Ġ2" and "20" never form: the space and every digit are pieces of their own
    assert tokenizer.encode(TEXT) == token_ids("I ' m Ġ 2 0 2 4 Ġ Ġ x ! ! Ċ ĊĠ Ġ y Ġ W E ' L L")


@pytest.mark.parametrize("pre", LLAMA3_NAMES)
def test_the_llama3_family_splits_as_llama3(monkeypatch, pre):
    tokenizer = build(monkeypatch, pre)
    assert pieces(tokenizer, TRICKY) == LLAMA3_PIECES
    # digits in threes ("202" merges to "20 2"), "'LL" one piece, "\n\n" apart from the spaces
    assert tokenizer.encode(TEXT) == token_ids("I ' m Ġ 20 2 4 Ġ Ġ x ! ! Ċ Ċ Ġ Ġ y Ġ W E 'L L")


def test_decoding_gives_the_text_back(monkeypatch):
    for pre in ("gpt2", "smollm", "llama3"):
        tokenizer = build(monkeypatch, pre)
        assert tokenizer.decode(tokenizer.encode(TRICKY)) == TRICKY


def test_an_unknown_split_goes_to_the_transformers_converter(monkeypatch):
    from transformers import AutoTokenizer

    calls = []
    monkeypatch.setattr(tokenizer_module, "gguf_tokenizer_metadata", lambda path: metadata("qwen2"))
    monkeypatch.setattr(tokenizer_module, "gguf_architecture_name", lambda path: "qwen2")
    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", lambda *args, **kwargs: calls.append((args, kwargs))
    )
    gguf_tokenizer("models/tiny.gguf")
    assert calls == [(("models",), {"gguf_file": "tiny.gguf"})]
