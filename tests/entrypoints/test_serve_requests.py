"""The server's request and response pieces that run without a server: bodies, errors, logprobs.

Proves: ``parse_body`` refuses bodies that are not UTF-8, not JSON, not an object, that hold a
lone surrogate (naming where) or a field of the wrong type (naming it); a field neither API
implements is refused unless it holds its neutral value (``True`` is not ``1``); ``stop``,
message text and ``max_completion_tokens`` read as OpenAI's; ``sampling_params`` maps each field
and names the field the engine refuses; errors have OpenAI's shape with the type of their status;
log-probabilities come in the completions and chat shapes, with ``token_id:<id>`` names without a
tokenizer.
Run: pytest tests/entrypoints/test_serve_requests.py
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from pieceworks.entrypoints.serve import logprobs as lp  # noqa: E402
from pieceworks.entrypoints.serve.errors import (  # noqa: E402
    APIError,
    bad_request,
    error_body,
    error_response,
)
from pieceworks.entrypoints.serve.protocol import (  # noqa: E402
    UNSUPPORTED_FIELDS,
    UNSUPPORTED_HINTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from pieceworks.entrypoints.serve.validation import (  # noqa: E402
    ModelLimits,
    check_prompt,
    parse_body,
    sampling_params,
)


def refusal(body: bytes, model=CompletionRequest) -> APIError:
    with pytest.raises(APIError) as error:
        parse_body(body, model)
    assert error.value.status_code == 400
    return error.value


def test_parse_body_names_what_is_wrong():
    error = refusal(b'{"prompt": "\xff"}')
    assert error.message == (
        "the request body is not valid UTF-8 (invalid start byte at byte 12); send JSON encoded "
        "as UTF-8"
    )
    assert refusal(b'{"prompt": ').message.startswith("the request body is not valid JSON: ")
    assert refusal(b"[1]").message == "the request body must be a JSON object"
    error = refusal(b'{"prompt": "a", "stop": ["x", "\\ud800"]}')
    assert error.param == "stop.1"
    assert error.message == (
        "field 'stop.1' is not valid Unicode text: it holds a lone surrogate (half of a UTF-16 "
        "pair, such as \\ud800); send whole characters"
    )
    error = refusal(
        b'{"messages": [{"role": "user", "content": "\\udc00"}]}', ChatCompletionRequest
    )
    assert error.param == "messages.0.content"
    assert refusal(b'"\\ud800"').message == "the request body must be a JSON object"
    error = refusal(b'{"prompt": "a", "n": "many"}')
    assert error.param == "n" and error.message.startswith("invalid field 'n': ")
    assert refusal(b"{}").param == "prompt"
    body = parse_body(
        json.dumps({"prompt": "hi", "extra": {"k": [1, "ok"]}}).encode(), CompletionRequest
    )
    assert body.prompt == "hi"


@pytest.mark.parametrize(
    "api, model", [("completions", CompletionRequest), ("chat", ChatCompletionRequest)]
)
def test_unsupported_fields_are_refused_unless_neutral(api, model):
    base = (
        {"prompt": "x"}
        if api == "completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    for name, neutral in UNSUPPORTED_FIELDS[api].items():
        for value in neutral:
            model.model_validate({**base, name: value})
        error = refusal(json.dumps({**base, name: "surely not neutral"}).encode(), model)
        assert error.param == name
        hint = UNSUPPORTED_HINTS.get(name, "leave it out")
        assert f"this server does not implement {name}; {hint}" in error.message
    refusal(json.dumps({**base, "min_p": True}).encode(), model)  # True is not 1
    refusal(json.dumps({**base, "use_beam_search": 0}).encode(), model)  # 0 is not False
    model.model_validate({**base, "repetition_penalty": 1})


def test_stop_strings_message_text_and_max_tokens():
    assert CompletionRequest(prompt="x").stop_strings() == []
    assert CompletionRequest(prompt="x", stop="a").stop_strings() == ["a"]
    assert CompletionRequest(prompt="x", stop=["a", "b"]).stop_strings() == ["a", "b"]
    assert CompletionRequest(prompt="x").max_tokens == 16
    assert ChatMessage(role="user").text() == ""
    assert ChatMessage(role="user", content="hi").text() == "hi"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert ChatMessage(role="user", content=parts).text() == "ab"
    messages = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=messages).requested_max_tokens() is None
    assert ChatCompletionRequest(messages=messages, max_tokens=5).requested_max_tokens() == 5
    both = ChatCompletionRequest(messages=messages, max_tokens=5, max_completion_tokens=3)
    assert both.requested_max_tokens() == 3


def test_sampling_params_maps_every_field():
    body = CompletionRequest(
        prompt="x", temperature=0.5, top_p=0.8, top_k=4, seed=10, stop_token_ids=[3, 4],
        ignore_eos=True, stop=["z"], skip_special_tokens=False,
    )  # fmt: skip
    params = sampling_params(body, 9, index=2, logprobs=3)
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.8, 4)
    assert (params.max_tokens, params.seed, params.stop_token_ids) == (9, 12, (3, 4))
    assert (params.ignore_eos, params.stop, params.logprobs) == (True, ("z",), 3)
    assert params.skip_special_tokens is False
    params = sampling_params(CompletionRequest(prompt="x"), 4)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, 0, None)
    assert (params.stop_token_ids, params.ignore_eos, params.stop) == ((), False, ())
    assert params.logprobs is None and params.skip_special_tokens is True
    for field in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(APIError, match="presence_penalty and frequency_penalty are not"):
            sampling_params(CompletionRequest(prompt="x", **{field: 0.5}), 4)
    with pytest.raises(APIError) as error:
        sampling_params(CompletionRequest(prompt="x", seed=2**70), 4)
    assert error.value.param == "seed" and error.value.message.startswith(f"seed={2**70} must")
    with pytest.raises(APIError) as error:
        sampling_params(CompletionRequest(prompt="x"), 0)
    assert error.value.param == "max_tokens"
    with pytest.raises(APIError) as error:  # the message opens with no field=: no param
        sampling_params(CompletionRequest(prompt="x", stop_token_ids=[-1]), 4)
    assert error.value.param is None
    assert error.value.message == "stop_token_ids must be non-negative integers; got [-1]"


def test_errors_have_openais_shape():
    for status, kind in [
        (400, "BadRequestError"), (401, "AuthenticationError"), (404, "NotFoundError"),
        (413, "BadRequestError"), (503, "ServiceUnavailableError"),
        (500, "InternalServerError"), (418, "APIError"),
    ]:  # fmt: skip
        assert error_body(status, "why", "p") == {
            "error": {"message": "why", "type": kind, "param": "p", "code": status}
        }
    assert error_body(400, "why")["error"]["param"] is None
    error = bad_request("nope", param="n")
    assert (error.status_code, error.message, error.param, str(error)) == (400, "nope", "n", "nope")
    assert error.headers is None and bad_request("x").param is None
    response = error_response(APIError(503, "busy", headers={"Retry-After": "1"}))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(response.body) == error_body(503, "busy")


class Tokenizer:
    def decode(self, ids):
        return {1: "a", 2: "bc", 3: "é"}[ids[0]]


def entry(token_id, logprob, top):
    return SimpleNamespace(
        token_id=token_id,
        logprob=logprob,
        top_ids=[i for i, _ in top],
        top_logprobs=[p for _, p in top],
    )


def test_logprobs_in_both_shapes():
    entries = [entry(2, -0.5, [(2, -0.5), (1, -1.0)]), entry(3, -0.25, [(3, -0.25)])]
    assert lp.completion_logprobs(entries, Tokenizer(), 7) == {
        "tokens": ["bc", "é"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"bc": -0.5, "a": -1.0}, {"é": -0.25}],
        "text_offset": [7, 9],
    }
    assert lp.chat_logprobs(entries[1:], Tokenizer()) == {
        "content": [
            {
                "token": "é",
                "logprob": -0.25,
                "bytes": [0xC3, 0xA9],
                "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]}],
            }
        ]
    }
    assert lp.completion_logprobs(entries[:1], None, 0)["tokens"] == ["token_id:2"]
    assert lp.completion_logprobs(entries, None, 0)["text_offset"] == [0, 10]
    assert lp.chat_logprobs(entries[:1], None)["content"][0]["top_logprobs"][1]["token"] == (
        "token_id:1"
    )


def test_prompt_refusals_name_the_prompt():
    limits = ModelLimits(max_model_len=10, vocab_size=50)
    for prompt, max_tokens in [([], 1), ([1, 50], 1), ([1, 2, 3], 8)]:
        with pytest.raises(APIError) as error:
            check_prompt(prompt, max_tokens, limits)
        assert error.value.status_code == 400 and error.value.param == "prompt"
    assert error.value.message == (
        "this model's maximum context length is 10 tokens; the prompt has 3 and max_tokens is 8: "
        "shorten the prompt or lower max_tokens"
    )
    check_prompt([1, 2, 3], 7, limits)
