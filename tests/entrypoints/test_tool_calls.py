"""The tool-call parsers and the streaming hold-back of ``serve/tool_calls.py``, without a server.

``hermes`` finds JSON ``{"name", "arguments"}`` in ``<tool_call>`` tags after optional text;
``llama3_json`` takes an answer that is wholly JSON objects ``{"name", "parameters"}`` joined by
";". Text that is not a well-formed call stays the answer's content, with no call. While
streaming in auto mode, text goes out until a call may have begun (the marker or a prefix of it
at the end of the text is held back); the enforced modes send no content.
Run: pytest tests/entrypoints/test_tool_calls.py
"""

from __future__ import annotations

import json

import pytest

from pieceworks.entrypoints.serve.tool_calls import (
    ToolCalling,
    parse_hermes,
    parse_llama3_json,
)


def _calls(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_hermes_reads_every_tagged_call_and_keeps_the_text_before():
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert _calls(calls) == [("weather", {"city": "Paris"}), ("time", {})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("chatcmpl-tool-")


def test_hermes_an_unclosed_last_call_still_counts():
    content, calls = parse_hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content is None and _calls(calls) == [("f", {"x": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",  # no call
        "<tool_call>{not json}</tool_call>",  # broken JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
    ],
)
def test_hermes_text_without_a_well_formed_call_is_the_content(text):
    assert parse_hermes(text) == (text, [])


def test_llama3_json_reads_objects_joined_by_semicolons():
    text = ' {"name": "a", "parameters": {"k": "v"}}; {"name": "b", "parameters": {}} '
    content, calls = parse_llama3_json(text)
    assert content is None and _calls(calls) == [("a", {"k": "v"}), ("b", {})]


@pytest.mark.parametrize(
    "text",
    ["plain prose", '{"name": "a", "parameters": {}} and then prose', '["name"]', ""],
)
def test_llama3_json_anything_but_calls_is_the_content(text):
    assert parse_llama3_json(text) == (text, [])


def test_required_mode_reads_the_enforced_array_and_named_mode_the_arguments():
    required = ToolCalling("required")
    content, calls = required.parse('[{"name": "a", "parameters": {"n": 2}}]')
    assert content is None and _calls(calls) == [("a", {"n": 2})]
    assert required.parse("not json") == ("not json", [])
    named = ToolCalling("named", function_name="weather")
    content, calls = named.parse(' {"city": "Oslo"} ')
    assert content is None and _calls(calls) == [("weather", {"city": "Oslo"})]


@pytest.mark.parametrize(
    ("text", "streamable"),
    [
        ("Sure, one moment", len("Sure, one moment")),  # no marker: everything goes out
        ("Sure <tool_call>{", len("Sure ")),  # the call begins: held from there
        ("Sure <tool_", len("Sure ")),  # a prefix of the marker at the end is held back
        ("Sure <b>", len("Sure <b>")),  # "<" followed by something else is text
    ],
)
def test_hermes_auto_streaming_holds_back_what_may_be_a_call(text, streamable):
    assert ToolCalling("auto", parser="hermes").streamable(text) == streamable


def test_llama3_json_auto_streaming_and_the_enforced_modes():
    auto = ToolCalling("auto", parser="llama3_json")
    assert auto.streamable("") == 0  # the answer may still open with a call
    assert auto.streamable('  {"name"') == 0
    assert auto.streamable("Hello") == len("Hello")
    assert ToolCalling("required").streamable("[{") == 0
    assert ToolCalling("named", function_name="f").streamable("{") == 0
