"""``POST /v1/completions``: prompts as text or token ids, ``n`` choices each.

OpenAI numbers the choices of a batch of prompts ``prompt_index * n + i``; this handler does the
same. A text prompt is tokenized as ``LLM.generate`` does it, so the server's greedy answer
equals the offline one. With ``return_token_ids`` (vLLM's extension) every choice, and every
streamed chunk, also carries its token ids, the only output of a model without a tokenizer.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pieceworks.entrypoints.serve.errors import bad_request
from pieceworks.entrypoints.serve.generation import (
    ChoiceDelta,
    ChoiceResult,
    ChoiceSpec,
    Generation,
)
from pieceworks.entrypoints.serve.logprobs import completion_logprobs
from pieceworks.entrypoints.serve.protocol import CompletionRequest
from pieceworks.entrypoints.serve.serving import ResponseFormat, ServingContext, respond
from pieceworks.entrypoints.serve.structured import request_constraint
from pieceworks.entrypoints.serve.validation import (
    check_prompt,
    parse_body,
    resolve_max_tokens,
    sampling_params,
)


def prompt_token_ids(ctx: ServingContext, prompt: Any) -> list[list[int]]:
    """Every prompt of the request as token ids (text needs the model's tokenizer)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("the prompt is empty; send text or at least one token id", "prompt")
    encoded = []
    for item in prompt:
        if isinstance(item, str):
            if ctx.tokenizer is None:
                raise bad_request(
                    "this model has no tokenizer (presets have random weights): send the prompt "
                    "as a list of token ids",
                    "prompt",
                )
            item = ctx.tokenizer.encode(item)
        encoded.append(list(item))
    return encoded


def _choice(
    body: CompletionRequest, index: int, text: str, token_ids: list[int], finish_reason: str | None
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if body.return_token_ids:
        choice["token_ids"] = token_ids
    return choice


def completion_format(body: CompletionRequest, tokenizer: Any) -> ResponseFormat:
    def chunk(header: dict[str, Any], delta: ChoiceDelta) -> dict[str, Any]:
        choice = _choice(body, delta.index, delta.text, delta.token_ids, delta.finish_reason)
        if delta.logprobs is not None:
            choice["logprobs"] = completion_logprobs(delta.logprobs, tokenizer, delta.text_offset)
        return {**header, "object": "text_completion", "choices": [choice]}

    def full(header: dict[str, Any], results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for r in results:
            choice = _choice(body, r.index, r.text, r.token_ids, r.finish_reason)
            if r.logprobs is not None:
                choice["logprobs"] = completion_logprobs(r.logprobs, tokenizer, 0)
            if body.return_token_ids:
                choice["prompt_token_ids"] = r.prompt_token_ids
            choices.append(choice)
        return {**header, "object": "text_completion", "choices": choices}

    return ResponseFormat("cmpl", chunk, lambda header, n: [], full)


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    body = parse_body(await request.body(), CompletionRequest)
    asked = request_constraint(body)  # (field, constraint) or None
    constraint = asked[1] if asked else None
    specs = []
    for ids in prompt_token_ids(ctx, body.prompt):
        max_tokens = resolve_max_tokens(body.max_tokens, len(ids), ctx.limits)
        check_prompt(ids, max_tokens, ctx.limits)
        for i in range(body.n):
            params = sampling_params(body, max_tokens, i, body.logprobs, constraint)
            specs.append(ChoiceSpec(ids, params))
    generation = Generation(ctx.engine, specs, ctx.tokenizer, ctx.metrics)
    return await respond(ctx, request, generation, completion_format(body, ctx.tokenizer), body)
