"""Tool calling for ``/v1/chat/completions``: ``tools``, ``tool_choice`` and the call parsers.

vLLM's rules: the chat template renders ``tools``; ``tool_choice`` "none" generates plain text;
"required" and a named function are enforced with structured output (vLLM's JSON schemas: for
"required" an array of ``{"name", "parameters"}`` objects, one of the tools each, at most one
when ``parallel_tool_calls`` is false; for a named function the object of its parameters); "auto"
(the default when tools are given) needs the server's ``--enable-auto-tool-choice`` and
``--tool-call-parser``, and the parser finds the calls in free text: ``hermes`` reads JSON
``{"name", "arguments"}`` inside ``<tool_call>...</tool_call>``, ``llama3_json`` a JSON object
``{"name", "parameters"}`` (several joined by ";") that is the whole answer. A choice with calls
answers ``tool_calls`` (id, type "function", name, arguments as a JSON string) and finishes
with "tool_calls"; its content is the text before the calls (or null).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from pieceworks.entrypoints.serve.errors import bad_request
from pieceworks.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string
    id: str = dataclasses.field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call(value: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []  # not a well-formed call: the text is the answer
        calls.append(call)
    return (text[:start].strip() or None), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    decoder, position, calls = json.JSONDecoder(), 0, []
    stripped = text.strip()
    while position < len(stripped):
        try:
            value, position = decoder.raw_decode(stripped, position)
        except ValueError:
            return text, []
        call = _call(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        while position < len(stripped) and stripped[position] in " \n\t;":
            position += 1
    return (None, calls) if calls else (text, [])


_PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
# Where each parser's calls can begin: text from here on is held back while streaming.
_STARTS = {"hermes": "<tool_call>", "llama3_json": "{"}


@dataclasses.dataclass
class ToolCalling:
    """How one request's answer becomes tool calls: ``mode`` "auto" (through ``parser``),
    "required" (a JSON array of calls) or "named" (the arguments of ``function_name``)."""

    mode: str
    parser: str | None = None
    function_name: str | None = None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer; the text as content when it holds none."""
        if self.mode == "named":
            return None, [ToolCall(self.function_name or "", text.strip())]
        if self.mode == "required":
            try:
                values = json.loads(text)
            except ValueError:
                return text, []
            calls = [_call(value, "parameters") for value in values]
            return (None, [c for c in calls if c]) if all(calls) else (text, [])
        assert self.parser is not None
        return _PARSERS[self.parser](text)

    def streamable(self, text: str) -> int:
        """How much of ``text`` (the answer so far) can go out as content now: all of it in
        auto mode until a call may have begun, none in the enforced modes."""
        if self.mode != "auto":
            return 0
        start = _STARTS[self.parser or ""]
        if start == "{":
            return 0 if not text.strip() or text.lstrip().startswith("{") else len(text)
        found = text.find(start)
        if found >= 0:
            return found
        for keep in range(min(len(start) - 1, len(text)), 0, -1):  # a prefix of the marker
            if start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def tool_calling(
    body: Any, parser: str | None, auto_enabled: bool
) -> tuple[ToolCalling | None, StructuredOutputsParams | None]:
    """The request's ``ToolCalling`` (None without tools or with "none") and the constraint
    that enforces "required" or a named function; 400 for a choice the request cannot make."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools; send the functions in tools", "tool_choice")
        return None, None
    functions = _functions(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None, None
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise bad_request(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser (hermes or llama3_json)",
                "tool_choice",
            )
        return ToolCalling("auto", parser), None
    if choice == "required":
        schema = _required_schema(functions, body.parallel_tool_calls is False)
        return ToolCalling("required"), StructuredOutputsParams(json=schema)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in functions:
        raise bad_request(
            f"tool_choice {choice!r} must be 'none', 'auto', 'required' or "
            f'{{"type": "function", "function": {{"name": one of {sorted(functions)}}}}}',
            "tool_choice",
        )
    return ToolCalling("named", function_name=name), StructuredOutputsParams(json=functions[name])


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """Each tool's name and the JSON schema of its parameters; 400 for a malformed entry."""
    functions = {}
    for index, tool in enumerate(tools if isinstance(tools, list) else [None]):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            tool is None
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise bad_request(
                f'tools[{index}] must be {{"type": "function", "function": {{"name": ..., '
                '"parameters": {...}}}',
                "tools",
            )
        functions[function["name"]] = function.get("parameters") or {"type": "object"}
    return functions


def _required_schema(functions: dict[str, dict[str, Any]], single: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of calls, each one of the tools."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if single:
        schema["maxItems"] = 1
    return schema
