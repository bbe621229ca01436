"""Streamed chunks written from templates are the JSON the shared encoder writes for their dicts.

Proves: a stream's envelope (``chunk_prefix``: id, created, model, object) followed by a choice
and ``]}`` is the encoder's JSON of the whole chunk; the completions and chat choices that skip
the encoder (text or content, finish reason, token ids) equal the encoder's JSON of the dict
they stand for, byte for byte, for text that JSON must escape (quotes, backslashes, control
characters, non-ASCII, a lone surrogate) and for every finish reason and token-id list.
Run: ``pytest tests/entrypoints/test_serve_chunks.py -q``
"""

from __future__ import annotations

import itertools
import types

import pytest

pytest.importorskip("fastapi")

from pieceworks.entrypoints.serve import chat, completions  # noqa: E402
from pieceworks.entrypoints.serve.serving import chunk_prefix, encode_json, usage_chunk  # noqa: E402

TEXTS = ["", "a", ' q"\\ \n\t\x00\x1f é 😀 \u2028', "\ud800"]
REASONS = [None, "stop", "length"]
TOKEN_IDS = [[], [5], [1, 2, 49151]]


def test_the_envelope_and_a_choice_are_the_whole_chunk():
    header = {"id": 'cmpl-"x"', "created": 1700000000, "model": "org/modèle"}
    choice = {"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}
    prefix = chunk_prefix(header, "text_completion")
    whole = encode_json({**header, "object": "text_completion", "choices": [choice]})
    assert f"{prefix}{encode_json(choice)}]}}\n\n" == f"data: {whole}\n\n"


@pytest.mark.parametrize("return_token_ids", [False, True])
def test_template_choices_equal_the_encoder(return_token_ids):
    body = types.SimpleNamespace(return_token_ids=return_token_ids)
    for text, reason, ids, index in itertools.product(TEXTS, REASONS, TOKEN_IDS, [0, 12]):
        given = ids if return_token_ids else None
        expected = encode_json(completions._choice(body, index, text, ids, reason))  # type: ignore[arg-type]
        assert completions._text_choice(index, text, reason, given) == expected
        content = {"content": text} if text else {}
        expected = encode_json(chat._choice(body, index, "delta", content, ids, reason))  # type: ignore[arg-type]
        assert chat._content_choice(index, text, reason, given) == expected


def test_the_usage_chunk_is_the_encoders():
    header = {"id": "chatcmpl-0f", "created": 1700000000, "model": 'org/"m"\\é'}
    counts = {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    whole = encode_json(
        {**header, "object": "chat.completion.chunk", "choices": [], "usage": counts}
    )
    prefix = chunk_prefix(header, "chat.completion.chunk")
    assert usage_chunk(prefix, counts) == f"data: {whole}\n\n"
