"""Structured output and tool calls through a real server and the ``openai`` client, on llama-tiny.

Proves (random weights, the 256-token byte tokenizer with its chat template; every constraint's
language is finite, so a random model completes it): 50 concurrent ``json_schema`` requests all
answer JSON that satisfies the schema; ``tool_choice="required"`` answers one ``tool_calls``
entry of a given tool whose arguments parse, with finish reason "tool_calls"; a named tool
choice calls that function; streamed, a tool call arrives as delta chunks with its index, id,
name and arguments; a schema xgrammar cannot compile, ``tool_choice`` without ``tools``, and
"auto" on a server without ``--enable-auto-tool-choice`` are 400s naming the field; an unknown
tool-call parser is refused at start-up; ``/metrics`` counts the constrained steps.
Run: pytest tests/entrypoints/test_serve_structured.py
"""

from __future__ import annotations

import concurrent.futures
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.entrypoints.serve.api_server import build_app  # noqa: E402
from tests.engine.tiny_tokenizer import save_tiny_tokenizer  # noqa: E402
from tests.entrypoints.server import running_server  # noqa: E402

MODEL = "llama-tiny"
MESSAGES = [{"role": "user", "content": "Hi"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "size"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "time", "parameters": CITY}},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokenizer = save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    llm = LLM(MODEL, enforce_eager=True, dtype="float32", max_num_seqs=16, tokenizer=tokenizer)
    with running_server(llm, MODEL) as (url, ctx):
        yield url, ctx


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def valid(value: dict) -> bool:
    return (
        set(value) == {"color", "size"}
        and value["color"] in ("red", "green", "blue")
        and type(value["size"]) is int
        and 0 <= value["size"] <= 99
    )


def test_fifty_concurrent_json_schema_requests_all_validate(client, server):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
    }

    def ask(seed: int):
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format=response_format, seed=seed,
            max_tokens=200,
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(50)))
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        assert valid(json.loads(choice.message.content)), choice.message.content
    metrics = httpx.get(f"{server[0]}/metrics", timeout=30).text
    assert "pieceworks:structured_output_steps{" in metrics
    assert 'structured_output_steps{model_name="llama-tiny"} 0.0' not in metrics


def test_completions_take_response_format_too(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    answer = client.completions.create(
        model=MODEL, prompt=[5, 9, 17], max_tokens=200, seed=3,
        extra_body={"response_format": response_format},
    )  # fmt: skip
    assert answer.choices[0].finish_reason == "stop"
    assert valid(json.loads(answer.choices[0].text)), answer.choices[0].text


def test_required_tool_choice_returns_a_parsable_call(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=200, seed=3,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name in ("weather", "time")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_named_tool_choice_calls_that_function(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "time"}},
    )  # fmt: skip
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "time"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_streamed_tool_call_arrives_in_delta_chunks(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100, seed=5, stream=True,
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )  # fmt: skip
    ids, names, arguments, reasons = [], [], "", []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                ids += [call.id] if call.id else []
                names += [call.function.name] if call.function.name else []
                arguments += call.function.arguments or ""
    assert len(ids) == 1 and names == ["weather"]
    assert json.loads(arguments)["city"] in ("Paris", "Rome")
    assert reasons[-1] == "tool_calls"


@pytest.mark.parametrize(
    "body, field, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "nope"}}}},
            "response_format", 'Unsupported type "nope"',
        ),
        ({"guided_regex": "a(b"}, "guided_regex", "Regex parsing error"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_field(server, body, field, words):
    response = httpx.post(
        f"{server[0]}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and words in error["message"]


def test_an_unknown_tool_call_parser_is_refused_at_start(server):
    with pytest.raises(ValueError, match="tool call parser 'mistral' is unknown"):
        build_app(server[1], [MODEL], tool_call_parser="mistral")
