"""``POST /v1/chat/completions``: messages through the model's chat template, ``n`` choices.

The conversation is rendered by ``LLM.apply_chat_template`` (the model's chat template, the
assistant's turn opened unless ``add_generation_prompt`` is false, no second BOS), so the server's
prompt is ``LLM.chat``'s. Streams follow OpenAI's shape: a first chunk per choice with
the assistant role, content deltas, and a last chunk with the finish reason.
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
from pieceworks.entrypoints.serve.logprobs import chat_logprobs
from pieceworks.entrypoints.serve.protocol import ChatCompletionRequest
from pieceworks.entrypoints.serve.serving import ResponseFormat, ServingContext, respond
from pieceworks.entrypoints.serve.validation import (
    check_logit_bias,
    check_prompt,
    parse_body,
    resolve_max_tokens,
    sampling_params,
)


def render_chat(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    """The conversation as prompt token ids, through the model's chat template."""
    tokenizer = ctx.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "this model has no chat template (presets have random weights and no tokenizer): "
            "use /v1/completions with token-id prompts",
            "messages",
        )
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        return ctx.apply_chat_template(messages, None, body.add_generation_prompt)
    except Exception as error:  # a template may refuse a conversation (roles out of order)
        raise bad_request(
            f"the chat template refused these messages: {error}", "messages"
        ) from None


def _choice(
    body: ChatCompletionRequest,
    index: int,
    key: str,
    message: dict[str, Any],
    token_ids: list[int] | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        key: message,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if body.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_format(body: ChatCompletionRequest, tokenizer: Any) -> ResponseFormat:
    def first(header: dict[str, Any], num_choices: int) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [
            {
                **header,
                "object": "chat.completion.chunk",
                "choices": [_choice(body, index, "delta", delta, None, None)],
            }
            for index in range(num_choices)
        ]

    def chunk(header: dict[str, Any], delta: ChoiceDelta) -> dict[str, Any]:
        content = {"content": delta.text} if delta.text else {}
        choice = _choice(body, delta.index, "delta", content, delta.token_ids, delta.finish_reason)
        if delta.logprobs is not None:
            choice["logprobs"] = chat_logprobs(delta.logprobs, tokenizer)
        return {**header, "object": "chat.completion.chunk", "choices": [choice]}

    def full(header: dict[str, Any], results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for r in results:
            message = {"role": "assistant", "content": r.text}
            choice = _choice(body, r.index, "message", message, r.token_ids, r.finish_reason)
            if r.logprobs is not None:
                choice["logprobs"] = chat_logprobs(r.logprobs, tokenizer)
            choices.append(choice)
        return {**header, "object": "chat.completion", "choices": choices}

    return ResponseFormat("chatcmpl", chunk, first, full)


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    body = parse_body(await request.body(), ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request(
            "top_logprobs needs logprobs=true (without it no log-probabilities are returned)",
            "top_logprobs",
        )
    ids = render_chat(ctx, body)
    max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(ids), ctx.limits)
    check_prompt(ids, max_tokens, ctx.limits)
    check_logit_bias(body.logit_bias, ctx.limits)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    specs = [ChoiceSpec(ids, sampling_params(body, max_tokens, i, logprobs)) for i in range(body.n)]
    generation = Generation(ctx.engine, specs, ctx.tokenizer, ctx.metrics)
    return await respond(ctx, request, generation, chat_format(body, ctx.tokenizer), body)
