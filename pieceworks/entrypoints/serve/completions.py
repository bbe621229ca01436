"""``POST /v1/completions``: prompts as text or token ids, ``n`` choices each.

OpenAI numbers the choices of a batch of prompts ``prompt_index * n + i``; this handler does the
same. A text prompt is tokenized as ``LLM.generate`` does it, so the server's greedy answer
equals the offline one. With ``return_token_ids`` (vLLM's extension) every choice, and every
streamed chunk, also carries its token ids, the only output of a model without a tokenizer.

``echo`` puts the prompt before each choice's text (a text prompt as sent, token ids decoded),
and with ``logprobs`` the prompt tokens' entries before the generated ones (the engine's
``prompt_logprobs``; the first token's log-probability is null, as nothing predicts it). As in
vLLM, a stream sends the prompt in each choice's first chunk, and ``max_tokens`` 0 (allowed only
with ``echo``) returns the prompt alone with finish reason "length": how lm-evaluation-harness
scores text.
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
from pieceworks.entrypoints.serve.logprobs import completion_logprobs
from pieceworks.entrypoints.serve.protocol import CompletionRequest
from pieceworks.entrypoints.serve.serving import (
    ResponseFormat,
    ServingContext,
    encode_json,
    encode_string,
    encode_token_ids,
    respond,
)
from pieceworks.entrypoints.serve.structured import request_constraint
from pieceworks.entrypoints.serve.validation import (
    check_logit_bias,
    check_prompt,
    resolve_max_tokens,
    sampling_params,
)


def prompt_token_ids(ctx: ServingContext, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """Every prompt of the request: its text (None for token ids) and its token ids (text
    needs the model's tokenizer)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("the prompt is empty; send text or at least one token id", "prompt")
    encoded: list[tuple[str | None, list[int]]] = []
    for item in prompt:
        if isinstance(item, str):
            if ctx.tokenizer is None:
                raise bad_request(
                    "this model has no tokenizer (presets have random weights): send the prompt "
                    "as a list of token ids",
                    "prompt",
                )
            encoded.append((item, ctx.tokenizer.encode(item)))
        else:
            encoded.append((None, list(item)))
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


def _text_choice(
    index: int, text: str, finish_reason: str | None, token_ids: list[int] | None
) -> str:
    """``encode_json(_choice(...))`` of a streamed choice without log-probabilities (its token
    ids when given), the common chunk, written from a template."""
    reason = "null" if finish_reason is None else encode_string(finish_reason)
    ids = "" if token_ids is None else f', "token_ids": {encode_token_ids(token_ids)}'
    return (
        f'{{"index": {index}, "text": {encode_string(text)}, "logprobs": null, '
        f'"finish_reason": {reason}{ids}}}'
    )


def completion_format(
    body: CompletionRequest, tokenizer: Any, prompts: list[tuple[str, list[int]]]
) -> ResponseFormat:
    """The completions shapes; ``prompts`` is each choice's prompt (text, ids), for ``echo``."""
    echoed: set[int] = set()

    def echo_of(index: int) -> tuple[str, list[int]]:
        """Choice ``index``'s prompt the first time its text is built with ``echo``; else none."""
        if not body.echo or index in echoed:
            return "", []
        echoed.add(index)
        return prompts[index]

    def logprobs(
        prompt_ids: list[int], prompt_entries: Any, entries: list[Any], offset: int
    ) -> dict[str, Any]:
        """The legacy shape of the prompt's entries (when echoed) and then the generated ones."""
        if not prompt_ids:
            return completion_logprobs(entries, tokenizer, offset)
        token_ids = [*prompt_ids, *(entry.token_id for entry in entries)]
        all_entries = [*(prompt_entries or [None] * len(prompt_ids)), *entries]
        return completion_logprobs(all_entries, tokenizer, offset, token_ids)

    def chunk(delta: ChoiceDelta) -> list[str]:
        prompt_text, prompt_ids = echo_of(delta.index) if body.echo else ("", [])
        text = prompt_text + delta.text if prompt_text else delta.text
        if delta.logprobs is None:
            token_ids = delta.token_ids if body.return_token_ids else None
            return [_text_choice(delta.index, text, delta.finish_reason, token_ids)]
        choice = _choice(body, delta.index, text, delta.token_ids, delta.finish_reason)
        if delta.logprobs is not None:
            # Later chunks' offsets count the prompt text the first chunk echoed.
            shift = len(prompts[delta.index][0]) if body.echo else 0
            offset = 0 if prompt_ids else shift + delta.text_offset
            entries = delta.logprobs
            choice["logprobs"] = logprobs(prompt_ids, delta.prompt_logprobs, entries, offset)
        return [encode_json(choice)]

    def full(header: dict[str, Any], results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for r in results:
            prompt_text, prompt_ids = echo_of(r.index)
            choice = _choice(body, r.index, prompt_text + r.text, r.token_ids, r.finish_reason)
            if r.logprobs is not None:
                choice["logprobs"] = logprobs(prompt_ids, r.prompt_logprobs, r.logprobs, 0)
            if body.return_token_ids:
                choice["prompt_token_ids"] = r.prompt_token_ids
            choices.append(choice)
        return {**header, "object": "text_completion", "choices": choices}

    return ResponseFormat("cmpl", chunk, lambda num_choices: [], full)


async def create_completion(ctx: ServingContext, body: CompletionRequest, receive: Any) -> Response:
    """Answer ``body`` (parsed by ``validation.parse_request``); ``receive`` is the
    connection's, for the disconnect of a client that leaves."""
    check_logit_bias(body.logit_bias, ctx.limits)
    asked = request_constraint(body)  # (field, constraint) or None
    constraint = asked[1] if asked else None
    # With echo the prompt's entries come first: k alternatives per prompt token too (vLLM's).
    prompt_logprobs = body.logprobs if body.echo else None
    specs, prompts = [], []
    for prompt_index, (text, ids) in enumerate(prompt_token_ids(ctx, body.prompt)):
        max_tokens = resolve_max_tokens(body.max_tokens, len(ids), ctx.limits, body.echo)
        check_prompt(ids, max_tokens, ctx.limits)
        if text is None:  # echo sends the ids' text; without echo no text is needed
            text = ctx.tokenizer.decode(ids) if body.echo and ctx.tokenizer is not None else ""
        for i in range(body.n):
            # max_tokens 0: the engine generates one token, which the choice drops.
            params = sampling_params(
                body,
                max(max_tokens, 1),
                i,
                body.logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=constraint,
            )
            specs.append(
                ChoiceSpec(
                    ids, params, prompt_index, priority=body.priority, prompt_only=max_tokens == 0
                )
            )
            prompts.append((text, ids))
    generation = Generation(ctx.engine, specs, ctx.tokenizer, ctx.metrics)
    fmt = completion_format(body, ctx.tokenizer, prompts)
    return await respond(ctx, receive, generation, fmt, body)
