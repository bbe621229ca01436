"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, as vLLM offers it.

``/tokenize`` takes a text ``prompt`` (``add_special_tokens`` defaults to true, so a model that
opens with BOS gets it, as ``/v1/completions`` tokenizes) or chat ``messages`` rendered by the
model's chat template as ``/v1/chat/completions`` renders them (``add_generation_prompt``;
``add_special_tokens`` defaults to false there, since the template writes the special tokens;
true encodes the rendered text again with them). It answers ``{"tokens", "count",
"max_model_len"}`` and, with ``return_token_strs``, each token's vocabulary string
(``token_strs``, else null). ``/detokenize`` takes ``{"tokens"}`` and answers ``{"prompt"}``:
the ids decoded with their special tokens. A model without a tokenizer (presets) refuses both.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from pieceworks.engine.inputs import PromptError, check_token_ids
from pieceworks.entrypoints.serve.chat import render_chat
from pieceworks.entrypoints.serve.errors import bad_request
from pieceworks.entrypoints.serve.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pieceworks.entrypoints.serve.serving import ServingContext
from pieceworks.entrypoints.serve.validation import parse_body


def _tokenizer(ctx: ServingContext) -> Any:
    if ctx.tokenizer is None:
        raise bad_request(
            "this model has no tokenizer (presets have random weights): there is nothing to "
            "tokenize with; serve a model directory or GGUF file that has one"
        )
    return ctx.tokenizer


async def tokenize(ctx: ServingContext, request: Request) -> dict[str, Any]:
    raw = await request.body()
    body: TokenizeChatRequest | TokenizeCompletionRequest
    if _has_messages(raw):
        body = parse_body(raw, TokenizeChatRequest)
    else:
        body = parse_body(raw, TokenizeCompletionRequest)
    tokenizer = _tokenizer(ctx)
    if isinstance(body, TokenizeChatRequest):
        ids = render_chat(ctx, body)  # type: ignore[arg-type]
        if body.add_special_tokens:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            ids = list(tokenizer.encode(text, add_special_tokens=True))
    else:
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    token_strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": ctx.limits.max_model_len,
        "tokens": ids,
        "token_strs": token_strs,
    }


async def detokenize(ctx: ServingContext, request: Request) -> dict[str, Any]:
    body = parse_body(await request.body(), DetokenizeRequest)
    tokenizer = _tokenizer(ctx)
    if body.tokens:
        try:
            check_token_ids(body.tokens, ctx.limits.vocab_size, "tokens")
        except PromptError as error:
            raise bad_request(str(error), param="tokens") from None
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _has_messages(raw: bytes) -> bool:
    """Whether the body is a chat request (it has ``messages``); a body that does not parse is
    left to ``parse_body``, which says why."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and "messages" in data
