"""Prompt and sampling-parameter parsing for ``LLM.generate`` and the server: all checked first.

``parse_prompts`` turns what a caller passed into one ``ParsedPrompt`` (text, token ids) per
prompt, or raises a ``PromptError`` naming the prompt's index before anything is queued, so a bad
prompt in a batch never leaves the good ones behind in the engine. The forms are vLLM's:

- a string (needs a tokenizer), or ``{"prompt": "..."}``;
- a list of token ids, or ``{"prompt_token_ids": [...]}``;
- a list of those, one per request.

A flat list of ints at the top level (``generate([1, 2, 3])``) is refused: vLLM's ``generate``
reads its first argument as a sequence of prompts, so each int would be a prompt of its own,
which is never what was meant; the message says to wrap it. Token ids must be ints (not floats or
bools) inside the model's vocabulary; empty prompts are refused. ``sampling_params_for`` checks
the sampling parameters the same way. Lengths against ``max_model_len`` and the KV cache are the
engine's to check (``EngineCore.add_requests``), also before queuing.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from pieceworks.sampling_params import SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids")
_INT_ONLY = {int}  # the element types of token ids that need no closer look


class PromptError(ValueError):
    """A prompt or sampling parameter that cannot be run; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class ParsedPrompt:
    """One request's prompt: the text it came from (None for token ids) and its token ids."""

    text: str | None
    token_ids: list[int]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_flat_token_list(prompts: Any) -> bool:
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(map(_is_token_id, prompts))


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def as_prompt_list(prompts: Any) -> list[Any]:
    """The caller's ``prompts`` as a list with one entry per request."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if _is_flat_token_list(prompts):
        raise PromptError(
            f"prompts={_describe(prompts)} is a flat list of token ids; generate takes a list "
            f"of prompts: pass [{_describe(list(prompts))}] (one prompt of token ids) or "
            f'[{{"prompt_token_ids": {_describe(list(prompts))}}}]'
        )
    if not isinstance(prompts, (list, tuple)):
        raise PromptError(
            f"prompts must be a string, a list of token ids in a list, a dict with 'prompt' or "
            f"'prompt_token_ids', or a list of these; got {type(prompts).__name__}"
        )
    return list(prompts)


def check_token_ids(token_ids: Any, vocab_size: int | None, where: str) -> list[int]:
    """``token_ids`` as a list of ints in ``[0, vocab_size)``; a ``PromptError`` if not."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise PromptError(f"{where}: token ids must be a list of ints, not {_describe(token_ids)}")
    if len(token_ids) == 0:
        raise PromptError(f"{where} is empty; pass at least one token")
    if (  # the usual case in C-level passes; the loop below finds what is wrong otherwise
        {*map(type, token_ids)} == _INT_ONLY
        and min(token_ids) >= 0
        and (vocab_size is None or max(token_ids) < vocab_size)
    ):
        return list(token_ids)
    for position, token in enumerate(token_ids):
        if not _is_token_id(token):
            raise PromptError(
                f"{where}: token ids must be ints; position {position} holds "
                f"{_describe(token)} ({type(token).__name__})"
            )
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise PromptError(
                f"{where}: token id {token} at position {position} is outside this model's "
                f"vocabulary [0, {vocab_size})"
            )
    return [int(token) for token in token_ids]


def check_unicode(text: str, where: str) -> str:
    """``text`` if it is valid Unicode; a ``PromptError`` naming the position of a lone surrogate
    (half of a UTF-16 pair, e.g. ``"\\ud800"``), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PromptError(
            f"{where} is not valid Unicode text: it holds a lone surrogate "
            f"{text[error.start]!r} at position {error.start} (half of a UTF-16 pair); send "
            "whole characters"
        ) from None
    return text


def _parse_text(text: Any, encode: Callable[[str], list[int]] | None, where: str) -> list[int]:
    if not isinstance(text, str):
        raise PromptError(f"{where}: 'prompt' must be a string, not {_describe(text)}")
    if not text:
        raise PromptError(f"{where} is an empty string; pass some text")
    if encode is None:
        raise PromptError(
            f"{where} is text, which needs a tokenizer; this model has none (presets have "
            "random weights): pass token ids instead"
        )
    return list(encode(check_unicode(text, where)))


def parse_prompt(
    prompt: Any,
    index: int,
    encode: Callable[[str], list[int]] | None,
    vocab_size: int | None,
) -> ParsedPrompt:
    """One prompt in any accepted form; errors name it as ``prompt <index>``."""
    where = f"prompt {index}"
    if isinstance(prompt, dict):
        keys = [key for key in PROMPT_KEYS if key in prompt]
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown or len(keys) != 1:
            raise PromptError(
                f"{where}: a dict prompt takes exactly one of 'prompt' (text) or "
                f"'prompt_token_ids'; got keys {sorted(prompt)}"
            )
        if keys == ["prompt_token_ids"]:
            return ParsedPrompt(None, check_token_ids(prompt[keys[0]], vocab_size, where))
        prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise PromptError(f"{where}: 'prompt' must be a string, not {_describe(prompt)}")
    if isinstance(prompt, str):
        token_ids = _parse_text(prompt, encode, where)
        return ParsedPrompt(prompt, check_token_ids(token_ids, vocab_size, where))
    return ParsedPrompt(None, check_token_ids(prompt, vocab_size, where))


def parse_prompts(
    prompts: Any,
    *,
    encode: Callable[[str], list[int]] | None = None,
    vocab_size: int | None = None,
) -> list[ParsedPrompt]:
    """Every prompt parsed and checked, in order; the first bad one raises ``PromptError``."""
    return [
        parse_prompt(prompt, index, encode, vocab_size)
        for index, prompt in enumerate(as_prompt_list(prompts))
    ]


def sampling_params_for(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: a single one is shared, a list must match in length."""
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise PromptError(
            f"sampling_params must be a SamplingParams or a list of them (one per prompt), not "
            f"{type(sampling_params).__name__}"
        )
    bad = [i for i, params in enumerate(sampling_params) if not isinstance(params, SamplingParams)]
    if bad:
        raise PromptError(
            f"sampling_params[{bad[0]}] is a {type(sampling_params[bad[0]]).__name__}, not a "
            "SamplingParams"
        )
    if len(sampling_params) != num_prompts:
        raise PromptError(
            f"{len(sampling_params)} SamplingParams for {num_prompts} prompts; pass one, or one "
            "per prompt"
        )
    return list(sampling_params)
