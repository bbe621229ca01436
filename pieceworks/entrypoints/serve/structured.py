"""A request's output constraint: OpenAI's ``response_format`` and vLLM's structured-output fields.

``request_constraint(body)`` reads, in vLLM's names, ``response_format`` (``{"type": "text"}``,
``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema",
"strict"}}``), vLLM's newer ``structured_outputs`` object (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``, ``disable_any_whitespace``) and its older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``; at most one of them may ask for a
constraint. The constraint is parsed by xgrammar here (``check_grammar``), so a schema, regex or
grammar it cannot compile is a 400 naming the field and xgrammar's reason before the request
reaches the engine, which compiles it against the tokenizer (``worker/structured_output.py``).
"""

from __future__ import annotations

import json
from typing import Any

from pieceworks.entrypoints.serve.errors import bad_request
from pieceworks.sampling_params import StructuredOutputsParams
from pieceworks.worker.structured_output import check_grammar

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def request_constraint(body: Any) -> tuple[str, StructuredOutputsParams] | None:
    """(the field that asked, its constraint), or None when the request asks for none."""
    asked: list[tuple[str, StructuredOutputsParams]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            asked.append(("response_format", constraint))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    for field, kind in _GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            asked.append((field, _make(field, **{kind: value})))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad_request(f"send one output constraint, not several ({names})", asked[1][0])
    if not asked:
        return None
    field, constraint = asked[0]
    check(field, constraint)
    return field, constraint


def check(field: str, constraint: StructuredOutputsParams) -> None:
    """400 naming ``field`` when xgrammar cannot parse ``constraint``."""
    try:
        check_grammar(constraint)
    except ValueError as error:
        raise bad_request(f"{field}: {error}", field) from None


def _make(field: str, **fields: Any) -> StructuredOutputsParams:
    if isinstance(fields.get("json"), str):
        try:
            json.loads(fields["json"])
        except ValueError as error:
            raise bad_request(f"{field}: the json schema is not JSON ({error})", field) from None
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as error:
        raise bad_request(f"{field}: {error}", field) from None


def _response_format(value: Any) -> StructuredOutputsParams | None:
    field = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _make(field, json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format json_schema needs json_schema.schema, a JSON schema object",
                field,
            )
        return _make(field, json=schema)
    raise bad_request(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
        "'json_schema'",
        field,
    )


def _structured_outputs(value: Any) -> StructuredOutputsParams:
    field = "structured_outputs"
    if not isinstance(value, dict) or set(value) - set(_STRUCTURED_KEYS):
        unknown = sorted(set(value) - set(_STRUCTURED_KEYS)) if isinstance(value, dict) else []
        raise bad_request(
            f"structured_outputs must be an object with one of {', '.join(_STRUCTURED_KEYS[:5])}"
            + (f"; unknown keys: {', '.join(unknown)}" if unknown else ""),
            field,
        )
    return _make(field, **value)
