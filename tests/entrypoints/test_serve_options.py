"""Every request option of ``/v1/completions`` in a value other than its default, on llama-tiny.

Proves, with the status and body a client sees (token-id prompts, ``return_token_ids``):
``max_tokens`` gives exactly that many tokens and finish reason "length", streamed or not; ``n``
gives that many choices numbered ``prompt_index * n + i``; a ``seed`` makes sampling reproducible
and two seeds differ; ``temperature`` 0, ``top_k`` 1 and a tiny ``top_p`` all give the greedy
tokens; a ``stop_token_ids`` entry ends the choice on that token with reason "stop"; ``logprobs`` k
gives k alternatives per token (none without it); ``stream_options.include_usage`` adds the usage
chunk and only then; ``return_token_ids`` false leaves the ids out; ``user`` changes nothing.
Invalid values, and fields the server does not implement (``suffix``, ``best_of``, vLLM's
``min_p``, ...), are refused with 400 naming the field. ``/metrics`` counts each
finished choice under its reason (length, stop, abort). One server for the whole file, its engine on
a thread of the test process (the text options are in ``test_serve_text_options.py``).
Run: pytest tests/entrypoints/test_serve_options.py
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402
from tests.entrypoints.server import finished_counts, running_server  # noqa: E402

MODEL = "llama-tiny"
PROMPT = [5, 17, 42, 99, 3]
OTHER_PROMPT = [7, 7, 200, 31]
NUM_GREEDY = 12
IDS = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    """The server and the offline greedy tokens of PROMPT and OTHER_PROMPT (ignore_eos)."""
    llm = LLM(MODEL, compilation_config={"level": 0}, dtype="float32", max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)
    greedy = [out.outputs[0].token_ids for out in llm.generate([PROMPT, OTHER_PROMPT], params)]
    with running_server(llm, MODEL) as (url, ctx):
        yield url, ctx, greedy


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)


def complete(url: str, **body) -> dict:
    response = post(url, {"prompt": PROMPT, **IDS, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(url: str, body: dict, path: str = "/v1/completions") -> list:
    """The decoded chunks of a streamed request, and the last line ([DONE])."""
    with httpx.stream(
        "POST", f"{url}{path}", json={"model": MODEL, **body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: ") :] for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_max_tokens_gives_exactly_that_many(server):
    url, _, greedy = server
    body = complete(url, prompt=PROMPT, max_tokens=3, temperature=0.0)
    (choice,) = body["choices"]
    assert choice["token_ids"] == greedy[0][:3]
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    chunks = stream_chunks(url, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, **IDS})
    tokens = [t for chunk in chunks for choice in chunk["choices"] for t in choice["token_ids"]]
    assert tokens == greedy[0][:3]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_default_max_tokens_is_16(server):
    body = complete(server[0], temperature=0.0)
    assert len(body["choices"][0]["token_ids"]) == 16


def test_n_choices_are_numbered_per_prompt(server):
    url, _, greedy = server
    body = complete(url, prompt=[PROMPT, OTHER_PROMPT], n=2, max_tokens=4, temperature=0.0)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in choices] == [greedy[0][:4]] * 2 + [greedy[1][:4]] * 2
    assert body["usage"]["completion_tokens"] == 16
    assert body["usage"]["prompt_tokens"] == len(PROMPT) + len(OTHER_PROMPT)  # once per prompt
    chunks = stream_chunks(url, {"prompt": PROMPT, "n": 2, "max_tokens": 4, **IDS})
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        streamed[choice["index"]].extend(choice["token_ids"])
    assert [len(tokens) for tokens in streamed.values()] == [4, 4]


def test_seed_reproduces_and_seeds_differ(server):
    url = server[0]

    def sample(seed: int) -> list[int]:
        body = complete(url, seed=seed, temperature=1.0, max_tokens=NUM_GREEDY)
        return body["choices"][0]["token_ids"]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)
    assert sample(11) != server[2][0]  # sampled, not greedy


@pytest.mark.parametrize(
    "options",
    [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-6}],
    ids=["temperature=0", "top_k=1", "top_p=1e-6"],
)
def test_options_that_leave_only_the_top_token_give_greedy(server, options):
    body = complete(server[0], seed=3, max_tokens=NUM_GREEDY, **options)
    assert body["choices"][0]["token_ids"] == server[2][0]


def test_top_k_and_top_p_change_sampling(server):
    """With one seed, a wide top_k / top_p samples what the full distribution does, a narrow one
    something else."""
    url = server[0]

    def sample(**options) -> list[int]:
        body = complete(url, seed=5, temperature=1.0, max_tokens=NUM_GREEDY, **options)
        return body["choices"][0]["token_ids"]

    full = sample()
    assert sample(top_k=-1) == full and sample(top_p=1.0) == full
    assert sample(top_k=2) != full
    assert sample(top_p=0.05) != full


def test_stop_token_ids_end_the_choice_there(server):
    url, _, greedy = server
    tokens = greedy[0]
    position = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    body = {"max_tokens": NUM_GREEDY, "temperature": 0.0, "stop_token_ids": [tokens[position]]}
    (choice,) = complete(url, **body)["choices"]
    assert choice["token_ids"] == tokens[: position + 1]  # the stop token is the last one
    assert choice["finish_reason"] == "stop"
    chunks = stream_chunks(url, {"prompt": PROMPT, **IDS, **body})
    streamed = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
    assert streamed == tokens[: position + 1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_count_is_the_requested_top(server, k):
    (choice,) = complete(server[0], max_tokens=4, temperature=0.0, logprobs=k)["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 4
    assert [len(top) for top in logprobs["top_logprobs"]] == [k] * 4
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"])


def test_no_logprobs_unless_asked(server):
    (choice,) = complete(server[0], max_tokens=2)["choices"]
    assert choice["logprobs"] is None


def test_include_usage_adds_a_usage_chunk_only_when_asked(server):
    url = server[0]
    body = {"prompt": PROMPT, "max_tokens": 3, **IDS}
    plain = stream_chunks(url, body)
    assert all("usage" not in chunk for chunk in plain)
    for options in ({}, {"include_usage": False}):
        chunks = stream_chunks(url, {**body, "stream_options": options})
        assert all("usage" not in chunk for chunk in chunks)
    chunks = stream_chunks(url, {**body, "stream_options": {"include_usage": True}})
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert all("usage" not in chunk for chunk in chunks[:-1])


def test_stream_and_non_stream_agree(server):
    url = server[0]
    body = {"prompt": PROMPT, "max_tokens": 6, "seed": 9, "temperature": 1.0, **IDS}
    whole = complete(url, **body)["choices"][0]["token_ids"]
    chunks = stream_chunks(url, body)
    assert [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]] == whole
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert len({chunk["id"] for chunk in chunks}) == 1


def test_token_ids_only_when_asked_and_user_is_accepted(server):
    url, _, greedy = server
    response = post(url, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "user": "u-1"})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    (choice,) = complete(url, max_tokens=3, temperature=0.0, user="u-1")["choices"]
    assert choice["token_ids"] == greedy[0][:3]
    assert choice["prompt_token_ids"] == PROMPT


INVALID = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"ignore_eos": "sometimes"}, "ignore_eos"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ({"seed": "seven"}, "seed"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1.0}, "frequency_penalty"),
]

UNSUPPORTED = [
    ("suffix", "the end"),
    ("best_of", 2),
    ("min_p", 0.1),
    ("repetition_penalty", 1.2),
    ("min_tokens", 4),
    ("use_beam_search", True),
    ("include_stop_str_in_output", True),
]


@pytest.mark.parametrize(
    "options, field", INVALID, ids=[f"{next(iter(o))}={next(iter(o.values()))}" for o, _ in INVALID]
)
def test_invalid_value_is_400_naming_the_field(server, options, field):
    response = post(server[0], {"prompt": PROMPT, **options})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert field in error["message"]


@pytest.mark.parametrize("field, value", UNSUPPORTED, ids=[name for name, _ in UNSUPPORTED])
def test_unimplemented_field_is_400_naming_it(server, field, value):
    response = post(server[0], {"prompt": PROMPT, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert f"'{field}'" in error["message"] and "not implement" in error["message"]


def test_every_refused_value_then_a_normal_request(server):
    """All the refused bodies one after another, bad values that overflow or pass the vocabulary
    among them: each is a 400, and afterwards the server still answers with the greedy tokens."""
    url, _, greedy = server
    refused = [options for options, _ in INVALID] + [{field: v} for field, v in UNSUPPORTED]
    refused += [{"seed": 2**70}, {"seed": -(2**64)}, {"prompt": [10**9]}, {"logprobs": 10**6}]
    for options in refused:
        response = post(url, {"prompt": PROMPT, **options})
        assert response.status_code == 400, (options, response.text)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    (choice,) = complete(url, max_tokens=NUM_GREEDY, temperature=0.0)["choices"]
    assert choice["token_ids"] == greedy[0]


@pytest.mark.parametrize(
    "field, value",
    [("suffix", None), ("best_of", 1), ("min_p", 0.0)],
)
def test_unimplemented_field_in_its_neutral_value_is_accepted(server, field, value):
    response = post(server[0], {"prompt": PROMPT, "max_tokens": 1, field: value})
    assert response.status_code == 200, response.text


def test_metrics_count_each_finish_reason(server):
    url, ctx, greedy = server
    before = finished_counts(url)
    complete(url, max_tokens=2)  # length
    complete(url, n=2, max_tokens=2)  # length, twice: one per choice
    stream_chunks(url, {"prompt": PROMPT, "max_tokens": 2, **IDS})  # length
    stop = {"temperature": 0.0, "max_tokens": NUM_GREEDY, "stop_token_ids": [greedy[0][0]]}
    complete(url, **stop)  # stop
    stream_chunks(url, {"prompt": PROMPT, **IDS, **stop})  # stop
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "stream": True, **IDS}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        next(response.iter_lines())  # the first chunk, then the client leaves: abort
    deadline = time.monotonic() + 10
    while finished_counts(url).get("abort", 0) == before.get("abort", 0):
        assert time.monotonic() < deadline, "the abort was never counted"
        time.sleep(0.05)
    post(url, {"prompt": PROMPT, "max_tokens": 0})  # refused: counts nowhere
    after = finished_counts(url)
    delta = {reason: after[reason] - before.get(reason, 0.0) for reason in after}
    assert delta == {"length": 4.0, "stop": 2.0, "abort": 1.0}
    while ctx.engine.stats.num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ctx.engine.stats.num_free_blocks == ctx.engine.stats.num_blocks
