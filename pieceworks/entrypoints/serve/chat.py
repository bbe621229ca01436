"""``POST /v1/chat/completions``: messages through the model's chat template, ``n`` choices.

The conversation is rendered by ``LLM.apply_chat_template`` (the model's chat template, the
assistant's turn opened unless ``add_generation_prompt`` is false, no second BOS), so the server's
prompt is ``LLM.chat``'s. Streams follow OpenAI's shape: a first chunk per choice with
the assistant role, content deltas, and a last chunk with the finish reason. ``response_format``
and vLLM's structured-output fields constrain the answer (``structured.py``); with ``tools`` the
answer may become tool calls (``tool_calls.py``): a streamed choice then holds back the text
that may hold calls and sends, when it finishes, one chunk per call with its index, id, type and
name (arguments "") and one with its arguments, as OpenAI streams them.
"""

from __future__ import annotations

from typing import Any

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
from pieceworks.entrypoints.serve.serving import (
    ResponseFormat,
    ServingContext,
    encode_json,
    encode_string,
    encode_token_ids,
    respond,
)
from pieceworks.entrypoints.serve.structured import request_constraint
from pieceworks.entrypoints.serve.tool_calls import ToolCalling, tool_calling
from pieceworks.entrypoints.serve.validation import (
    check_logit_bias,
    check_prompt,
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
    messages = [m.template_message() for m in body.messages]
    try:
        return ctx.apply_chat_template(messages, None, body.add_generation_prompt, body.tools)
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


def _with_calls(
    tools: ToolCalling | None, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished answer, tool calls parsed out, and its reason."""
    content, calls = tools.parse(text) if tools is not None else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.as_dict() for call in calls]
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return message, finish_reason


def chat_format(
    body: ChatCompletionRequest, tokenizer: Any, tools: ToolCalling | None = None
) -> ResponseFormat:
    texts: dict[int, str] = {}  # each streamed choice's text so far
    sent: dict[int, int] = {}  # how much of it went out as content

    def tool_chunks(delta: ChoiceDelta) -> list[str]:
        assert tools is not None
        index = delta.index
        text = texts[index] = texts.get(index, "") + delta.text
        start = sent.get(index, 0)
        if delta.finish_reason is None:
            end = max(tools.streamable(text), start)
            sent[index] = end
            if end == start:
                return []
            return [encode_json(_choice(body, index, "delta", {"content": text[start:end]},
                                        delta.token_ids, None))]  # fmt: skip
        content, calls = tools.parse(text)
        if not calls:
            rest = {"content": text[start:]} if text[start:] else {}
            return [encode_json(_choice(body, index, "delta", rest, None, delta.finish_reason))]
        chunks = []
        for position, call in enumerate(calls):
            named = call.as_dict(position)
            named["function"] = {"name": call.name, "arguments": ""}
            arguments = {"index": position, "function": {"arguments": call.arguments}}
            for piece in (named, arguments):
                delta_body = {"tool_calls": [piece]}
                chunks.append(encode_json(_choice(body, index, "delta", delta_body, None, None)))
        reason = "tool_calls" if delta.finish_reason == "stop" else delta.finish_reason
        chunks.append(encode_json(_choice(body, index, "delta", {}, None, reason)))
        return chunks

    def first(num_choices: int) -> list[str]:
        delta = {"role": "assistant", "content": ""}
        return [
            encode_json(_choice(body, index, "delta", delta, None, None))
            for index in range(num_choices)
        ]

    def chunk(delta: ChoiceDelta) -> list[str]:
        if tools is not None:
            return tool_chunks(delta)
        if delta.logprobs is None:
            token_ids = delta.token_ids if body.return_token_ids else None
            return [_content_choice(delta.index, delta.text, delta.finish_reason, token_ids)]
        content = {"content": delta.text} if delta.text else {}
        choice = _choice(body, delta.index, "delta", content, delta.token_ids, delta.finish_reason)
        if delta.logprobs is not None:
            choice["logprobs"] = chat_logprobs(delta.logprobs, tokenizer)
        return [encode_json(choice)]

    def full(header: dict[str, Any], results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for r in results:
            message, finish_reason = _with_calls(tools, r.text, r.finish_reason)
            choice = _choice(body, r.index, "message", message, r.token_ids, finish_reason)
            if r.logprobs is not None:
                choice["logprobs"] = chat_logprobs(r.logprobs, tokenizer)
            choices.append(choice)
        return {**header, "object": "chat.completion", "choices": choices}

    return ResponseFormat("chatcmpl", chunk, first, full)


def _content_choice(
    index: int, text: str, finish_reason: str | None, token_ids: list[int] | None
) -> str:
    """``encode_json(_choice(...))`` of a streamed choice without log-probabilities (its token
    ids when given), the common chunk, written from a template."""
    content = f'{{"content": {encode_string(text)}}}' if text else "{}"
    reason = "null" if finish_reason is None else encode_string(finish_reason)
    ids = "" if token_ids is None else f', "token_ids": {encode_token_ids(token_ids)}'
    return (
        f'{{"index": {index}, "delta": {content}, "logprobs": null, '
        f'"finish_reason": {reason}{ids}}}'
    )


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, receive: Any
) -> Response:
    """Answer ``body`` (parsed by ``validation.parse_request``); ``receive`` is the
    connection's, for the disconnect of a client that leaves."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request(
            "top_logprobs needs logprobs=true (without it no log-probabilities are returned)",
            "top_logprobs",
        )
    tools, tool_constraint = tool_calling(body, ctx.tool_call_parser, ctx.enable_auto_tool_choice)
    asked = request_constraint(body)
    if asked is not None and tool_constraint is not None:
        raise bad_request(
            f"tool_choice {body.tool_choice!r} constrains the answer; leave {asked[0]} out",
            asked[0],
        )
    constraint = tool_constraint or (asked[1] if asked else None)
    ids = render_chat(ctx, body)
    max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(ids), ctx.limits)
    check_prompt(ids, max_tokens, ctx.limits)
    check_logit_bias(body.logit_bias, ctx.limits)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    specs = [
        ChoiceSpec(
            ids,
            sampling_params(body, max_tokens, i, logprobs, structured_outputs=constraint),
            priority=body.priority,
        )
        for i in range(body.n)
    ]
    generation = Generation(ctx.engine, specs, ctx.tokenizer, ctx.metrics)
    fmt = chat_format(body, ctx.tokenizer, tools)
    return await respond(ctx, receive, generation, fmt, body)
