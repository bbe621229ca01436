"""From an HTTP body to what the engine takes: parsed, validated, or a 400 that says why.

``parse_body`` turns raw bytes into a protocol model (invalid UTF-8, malformed JSON and fields of
the wrong type are each their own 400); ``parse_request`` does the same for a generation request,
in one pass of pydantic's JSON parser where the body is valid. ``sampling_params`` is the one
place request fields map to ``SamplingParams``; ``check_prompt`` refuses prompts the model
cannot take before anything is queued. The engine checks again when the request is added (KV
capacity), and a refusal there comes back as a 400 too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pieceworks.engine.inputs import PromptError, check_token_ids
from pieceworks.entrypoints.serve.errors import bad_request
from pieceworks.entrypoints.serve.protocol import SamplingFields
from pieceworks.sampling_params import SamplingParams, StructuredOutputsParams

ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_body(body: bytes, model: type[ModelT]) -> ModelT:
    """Decode, parse and validate a JSON request body; 400 with the first reason found."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(
            f"the request body is not valid UTF-8 ({error.reason} at byte "
            f"{error.start}); send JSON encoded as UTF-8"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    where = _lone_surrogate(data, "")
    if where is not None:
        raise bad_request(
            f"field {where!r} is not valid Unicode text: it holds a lone surrogate (half of a "
            "UTF-16 pair, such as \\ud800); send whole characters",
            param=where,
        )
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise bad_request(f"invalid field {where!r}: {first['msg']}", param=where) from None


def parse_request(
    body: bytes, model: type[ModelT], check_model: Callable[[str | None], None]
) -> ModelT:
    """``body`` as ``model`` after ``check_model`` accepted its ``model`` field (a 404 for a
    model not served comes before any other fault of the body).

    The body is parsed and validated by pydantic's JSON parser in one pass. A body it refuses
    goes through ``model_field`` and ``parse_body``, which give the reason: the JSON parser
    refuses every body ``parse_body`` refuses (invalid UTF-8 or JSON, a lone surrogate in any
    string, a field that fails validation), so a valid body ends the same either way."""
    try:
        parsed = model.model_validate_json(body)
    except ValidationError:
        check_model(model_field(body))
        return parse_body(body, model)
    check_model(getattr(parsed, "model", None))
    return parsed


def model_field(body: bytes) -> str | None:
    """The body's ``model`` when it parses as a JSON object (the handler reports other faults)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def _lone_surrogate(value: Any, where: str) -> str | None:
    """The path of the first string in ``value`` that UTF-8 cannot encode (JSON's ``\\ud800``
    escapes decode to lone surrogates, which no tokenizer takes); None if every string is fine."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _lone_surrogate(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What a prompt is checked against: the model's context and vocabulary, and how many
    tokens the whole KV cache holds (``None``: no bound beyond the context)."""

    max_model_len: int
    vocab_size: int | None
    max_kv_tokens: int | None = None


def check_prompt(prompt_token_ids: list[int], max_tokens: int, limits: ModelLimits) -> None:
    """Refuse an empty prompt, ids that are not ints of the vocabulary (``LLM.generate``'s own
    check, ``engine.inputs.check_token_ids``), or a prompt too long for the context."""
    try:
        check_token_ids(prompt_token_ids, limits.vocab_size, "the prompt")
    except PromptError as error:
        raise bad_request(str(error), param="prompt") from None
    if len(prompt_token_ids) + max_tokens > limits.max_model_len:
        raise bad_request(
            f"this model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {len(prompt_token_ids)} and max_tokens is {max_tokens}: shorten the prompt or "
            "lower max_tokens",
            param="prompt",
        )


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, limits: ModelLimits, allow_zero: bool = False
) -> int:
    """The request's ``max_tokens``, or, when it gave none, what is left of the context (and of
    the KV cache: the last token's KV is never stored, hence the + 1). 0 only with
    ``allow_zero`` (``echo`` of completions: the prompt alone)."""
    if requested is None:
        room = limits.max_model_len - num_prompt_tokens
        if limits.max_kv_tokens is not None:
            room = min(room, limits.max_kv_tokens - num_prompt_tokens + 1)
        return max(room, 1)
    if requested == 0 and allow_zero:
        return 0
    if requested <= 0:
        least = "0 (with echo) or 1" if allow_zero else "1 (0 only with echo=true)"
        raise bad_request(f"max_tokens={requested} must be at least {least}", param="max_tokens")
    return requested


def check_logit_bias(bias: dict[int, float] | None, limits: ModelLimits) -> None:
    """Refuse ``logit_bias`` token ids outside the vocabulary."""
    vocab_size = limits.vocab_size
    if vocab_size is None:
        return  # the engine checks the ids against the model's own vocabulary
    outside = [token for token in bias or () if token >= vocab_size]
    if outside:
        raise bad_request(
            f"logit_bias names token ids {outside[:5]} outside this model's vocabulary of "
            f"{vocab_size} tokens (ids 0 to {vocab_size - 1})",
            param="logit_bias",
        )


def sampling_params(
    body: SamplingFields,
    max_tokens: int,
    index: int = 0,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's ``SamplingParams`` for choice ``index`` of ``body`` (400 if unsupported).

    Each choice is one engine request (``n`` = 1): with a ``seed`` and ``n`` > 1, choice ``i``
    samples with ``seed + i`` (``LLM.generate``'s rule), reproducible, and the choices differ.
    The server matches ``stop`` strings on the text itself (``TextStream``) and finishes the
    engine request when one is found.
    """
    if body.presence_penalty or body.frequency_penalty:
        raise bad_request("presence_penalty and frequency_penalty are not supported; send 0")
    fields: dict[str, Any] = {
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k or 0,
        "max_tokens": max_tokens,
        "seed": None if body.seed is None else body.seed + index,
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "ignore_eos": body.ignore_eos,
        "stop": body.stop_strings(),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": body.skip_special_tokens,
        "structured_outputs": structured_outputs,
        "logit_bias": body.logit_bias,
    }
    try:
        return SamplingParams(**fields)
    except ValueError as error:
        message = str(error)  # it opens with the field: "seed=... must be ..."
        name = message.split("=", 1)[0]
        raise bad_request(message, param=name if name in fields else None) from None
