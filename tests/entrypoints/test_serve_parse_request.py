"""``parse_request``: a generation request's body in one pass of pydantic's JSON parser.

Proves: a valid body parses to the model ``parse_body`` gives; every body ``parse_body`` refuses
(invalid UTF-8 or JSON, a lone surrogate in any string, even an ignored one, a field of the wrong
type, an unsupported field) is refused with ``parse_body``'s status, message and field; the
``model`` is checked before any other fault (a 404 first); ``check_prompt`` refuses ids outside
the vocabulary, bools and an empty prompt as ``engine.inputs.check_token_ids`` words them.
Run: pytest tests/entrypoints/test_serve_parse_request.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from pieceworks.entrypoints.serve.errors import APIError  # noqa: E402
from pieceworks.entrypoints.serve.protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
)
from pieceworks.entrypoints.serve.validation import (  # noqa: E402
    ModelLimits,
    check_prompt,
    parse_body,
    parse_request,
)

VALID = [
    (b'{"prompt": [1, 2], "max_tokens": 4, "stream": true, "temperature": 0}', CompletionRequest),
    (b'{"prompt": "a\\ud83d\\ude00", "stop": ["x"], "n": "2", "extra": 1e400}', CompletionRequest),
    (b'{"prompt": [true, 2.0], "logit_bias": {"5": -1}, "seed": 3}', CompletionRequest),
    (b'\t{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}\r\n',
     ChatCompletionRequest),
]  # fmt: skip
REFUSED = [
    b'{"prompt": "\xff"}',
    b'{"prompt": ',
    b"[1]",
    b'{"prompt": "a", "stop": ["x", "\\ud800"]}',
    b'{"prompt": [1], "ignored": {"deep": ["\\udc00"]}}',
    b'{"prompt": "a", "n": "many"}',
    b'{"prompt": [1], "best_of": 2}',
    b'{"prompt": [1], "priority": 1.0}',
    b'{"prompt": [1], "temperature": NaN}',
    b'\xef\xbb\xbf{"prompt": [1]}',
    b"{}",
]


def _no_check(model: str | None) -> None:
    return None


def _outcome(parse, body: bytes, model) -> tuple:
    try:
        return ("ok", parse(body, model).model_dump())
    except APIError as error:
        return (error.status_code, error.message, error.param)


@pytest.mark.parametrize("body, model", VALID)
def test_valid_bodies_parse_as_parse_body_parses_them(body, model):
    parsed = parse_request(body, model, _no_check)
    assert parsed.model_dump() == parse_body(body, model).model_dump()


@pytest.mark.parametrize("body", REFUSED)
def test_refused_bodies_get_parse_body_reasons(body):
    expected = _outcome(parse_body, body, CompletionRequest)
    assert expected[0] == 400
    got = _outcome(lambda raw, model: parse_request(raw, model, _no_check), body, CompletionRequest)
    assert got == expected


def test_the_model_is_checked_first():
    def check(model: str | None) -> None:
        if model != "served":
            raise APIError(404, f"not {model}")

    for body in (b'{"model": "other", "prompt": [1]}', b'{"model": "other", "n": 0}'):
        with pytest.raises(APIError) as error:
            parse_request(body, CompletionRequest, check)
        assert (error.value.status_code, error.value.message) == (404, "not other")
    assert parse_request(b'{"model": "served", "prompt": [1]}', CompletionRequest, check)


@pytest.mark.parametrize(
    "ids, message",
    [
        ([], "the prompt is empty; pass at least one token"),
        ([1, 300], "token id 300 at position 1 is outside this model's vocabulary [0, 256)"),
        ([-1], "token id -1 at position 0 is outside this model's vocabulary [0, 256)"),
        ([1, True], "token ids must be ints; position 1 holds True (bool)"),
    ],
)
def test_check_prompt_refuses_as_the_engine_words_it(ids, message):
    with pytest.raises(APIError) as error:
        check_prompt(ids, 1, ModelLimits(max_model_len=64, vocab_size=256))
    assert message in error.value.message and error.value.param == "prompt"
    check_prompt([0, 255], 1, ModelLimits(max_model_len=64, vocab_size=256))
