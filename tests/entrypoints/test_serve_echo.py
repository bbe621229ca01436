"""``echo``, prompt-only requests, ``logit_bias``, usage and refusals of ``/v1/completions``.

Proves on llama-tiny (token-id prompts, the openai client where it has the call): ``echo`` with
``logprobs`` returns the prompt's tokens and log-probabilities (the first null) equal to the
offline ``prompt_logprobs``, then the generated tokens' own, streamed or not, and with
``max_tokens`` 0 the prompt alone with finish reason "length" and no completion tokens; with
``n`` 2 usage counts the prompt once; ``logit_bias`` -100 on the greedy token changes it and +100
forces a token, on the server and offline (``SamplingParams.logit_bias``), and bad ids or values
are a 400 naming the field; ``best_of``, ``suffix``, ``tools``, an image content part and
``max_tokens`` 0 without ``echo`` are refused naming the field, and so is a ``priority`` other
than 0 on this first-come-first-served server (or not an int); unknown routes, wrong methods and
unknown models answer 404/405 in OpenAI's error shape, and ``GET /v1/models/{id}`` gives the model.
Run: pytest tests/entrypoints/test_serve_echo.py
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402
from tests.entrypoints.server import running_server  # noqa: E402

MODEL = "llama-tiny"
PROMPT = [5, 17, 42, 99, 3]
NUM_TOKENS = 4
TOP = 2  # logprobs asked for: alternatives per token


@pytest.fixture(scope="module")
def server():
    """The server, the offline prompt log-probabilities of PROMPT (top TOP) and its greedy
    tokens with their log-probabilities."""
    llm = LLM(MODEL, compilation_config={"level": 0}, dtype="float32", max_num_seqs=8)
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP
    )
    (offline,) = llm.generate([PROMPT], params)
    with running_server(llm, MODEL) as (url, ctx):
        yield url, llm, offline


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)


def expected_prompt_logprobs(offline) -> tuple[list, list]:
    """(token_logprobs, top_logprobs as {token_id: logprob}) of the prompt, offline."""
    logprobs, tops = [], []
    for token_id, position in zip(offline.prompt_token_ids, offline.prompt_logprobs):
        logprobs.append(None if position is None else position[token_id].logprob)
        tops.append(
            None
            if position is None
            else {f"token_id:{t}": lp.logprob for t, lp in position.items() if lp.rank <= TOP}
        )
    return logprobs, tops


def test_echo_logprobs_are_the_prompt_logprobs_then_the_generated(server):
    url, _, offline = server
    response = client(url).completions.create(
        model=MODEL,
        prompt=PROMPT,
        echo=True,
        logprobs=TOP,
        max_tokens=NUM_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    (choice,) = response.choices
    logprobs = choice.logprobs
    generated = offline.outputs[0]
    prompt_logprobs, prompt_tops = expected_prompt_logprobs(offline)
    assert logprobs.tokens == [f"token_id:{t}" for t in PROMPT + generated.token_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[: len(PROMPT)] == pytest.approx(prompt_logprobs)
    for served, expected in zip(logprobs.top_logprobs[1 : len(PROMPT)], prompt_tops[1:]):
        assert served == pytest.approx(expected)
    offline_generated = [p[t].logprob for t, p in zip(generated.token_ids, generated.logprobs)]
    assert logprobs.token_logprobs[len(PROMPT) :] == pytest.approx(offline_generated)
    assert len(logprobs.text_offset) == len(PROMPT) + NUM_TOKENS
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(PROMPT)
    assert response.usage.completion_tokens == NUM_TOKENS


def test_max_tokens_0_with_echo_returns_the_prompt_alone(server):
    url, _, offline = server
    response = client(url).completions.create(
        model=MODEL, prompt=[PROMPT, PROMPT[:3]], echo=True, logprobs=1, max_tokens=0
    )
    first, second = response.choices
    prompt_logprobs, _ = expected_prompt_logprobs(offline)
    assert first.logprobs.tokens == [f"token_id:{t}" for t in PROMPT]
    assert first.logprobs.token_logprobs == pytest.approx(prompt_logprobs)
    assert len(second.logprobs.tokens) == 3 and second.logprobs.token_logprobs[0] is None
    assert second.logprobs.token_logprobs[1:] == pytest.approx(prompt_logprobs[1:3])
    assert first.finish_reason == second.finish_reason == "length"
    assert first.text == second.text == ""  # no tokenizer: no text
    assert response.usage.prompt_tokens == len(PROMPT) + 3
    assert response.usage.completion_tokens == 0


def test_max_tokens_0_streamed_sends_the_prompt_in_one_chunk(server):
    url, _, offline = server
    stream = client(url).completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert len(chunks) == 1 and chunks[0].finish_reason == "length"
    prompt_logprobs, _ = expected_prompt_logprobs(offline)
    assert chunks[0].logprobs.token_logprobs == pytest.approx(prompt_logprobs)


def test_echo_streamed_puts_the_prompt_in_each_choices_first_chunk(server):
    url, _, offline = server
    body = {"prompt": PROMPT, "echo": True, "logprobs": 0, "n": 2, "stream": True}
    body |= {"max_tokens": NUM_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL, **body}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    tokens: dict[int, list[str]] = {0: [], 1: []}
    logprobs: dict[int, list] = {0: [], 1: []}
    for line in lines:
        (choice,) = json.loads(line)["choices"]
        tokens[choice["index"]] += choice["logprobs"]["tokens"]
        logprobs[choice["index"]] += choice["logprobs"]["token_logprobs"]
    generated = offline.outputs[0].token_ids
    prompt_logprobs, _ = expected_prompt_logprobs(offline)
    for index in (0, 1):
        assert tokens[index] == [f"token_id:{t}" for t in PROMPT + generated]
        assert logprobs[index][: len(PROMPT)] == pytest.approx(prompt_logprobs)


def test_n_choices_count_the_prompt_once(server):
    url = server[0]
    response = client(url).completions.create(
        model=MODEL, prompt=PROMPT, n=2, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert len(response.choices) == 2
    assert response.usage.prompt_tokens == len(PROMPT)
    assert response.usage.completion_tokens == 6


def greedy_ids(url: str, **body) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True, **body}
    response = post(url, {"return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_logit_bias_bans_and_forces_tokens(server):
    url, llm, offline = server
    greedy = offline.outputs[0].token_ids
    banned = greedy_ids(url, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0]
    assert greedy_ids(url, logit_bias={"7": 100}) == [7, 7]
    sampled = greedy_ids(url, logit_bias={"7": 100}, temperature=1.0, seed=3)
    assert sampled == [7, 7]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={7: 100})
    (output,) = llm.generate([PROMPT], params)
    assert output.outputs[0].token_ids == [7, 7]
    params = SamplingParams(
        temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={greedy[0]: -100}
    )
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == banned


@pytest.mark.parametrize(
    "bias, words",
    [
        ({"seven": 1}, "not a token id"),
        ({"7": 101}, "[-100, 100]"),
        ({"7": "a lot"}, "must be a number"),
        ({"100000": 1}, "outside this model's vocabulary"),
        ([7], "must be an object"),
    ],
)
def test_bad_logit_bias_is_400_naming_it(server, bias, words):
    response = post(server[0], {"prompt": PROMPT, "logit_bias": bias})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and words in error["message"]


def test_offline_logit_bias_is_checked():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 200})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"3": 1})


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({"best_of": 2}, "best_of", "send n"),
        ({"suffix": "the end"}, "suffix", "suffix"),
        ({"max_tokens": 0}, "max_tokens", "echo"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "chat feature"),
        ({"tool_choice": "required"}, "tool_choice", "chat feature"),
    ],
)
def test_refused_completion_fields_are_named(server, body, field, words):
    response = post(server[0], {"prompt": PROMPT, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and words in error["message"]


@pytest.mark.parametrize(
    ("priority", "words"), [(3, "scheduling_policy='priority'"), ("high", "valid integer")]
)
def test_priority_under_fcfs_or_not_an_int_is_400_naming_it(server, priority, words):
    response = post(server[0], {"prompt": PROMPT, "max_tokens": 1, "priority": priority})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority" and words in error["message"], error
    assert post(server[0], {"prompt": PROMPT, "max_tokens": 1, "priority": 0}).status_code == 200


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_non_text_content_part_is_refused_naming_its_type(server, kind):
    part = {"type": kind, kind: {"url": "https://example.com/cat.png"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    response = post(server[0], body, "/v1/chat/completions")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.0.content"
    assert f"part 1 has type '{kind}'" in error["message"] and "text only" in error["message"]


def assert_openai_error(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and words in error["message"]


def test_404_and_405_are_in_openai_shape(server):
    url = server[0]
    assert_openai_error(httpx.get(f"{url}/v1/nothing"), 404, "no route GET /v1/nothing")
    assert_openai_error(httpx.post(f"{url}/v2/completions", json={}), 404, "/v1/completions")
    assert_openai_error(httpx.get(f"{url}/v1/completions"), 405, "takes POST")
    assert_openai_error(httpx.delete(f"{url}/v1/models"), 405, "takes GET")
    assert_openai_error(httpx.get(f"{url}/v1/models/gpt-4"), 404, "'gpt-4' does not exist")
    assert_openai_error(post(url, {"model": "gpt-4", "prompt": PROMPT}), 404, "does not exist")
    with pytest.raises(openai.NotFoundError):
        client(url).models.retrieve("gpt-4")


def test_known_model_is_retrieved(server):
    model = client(server[0]).models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
