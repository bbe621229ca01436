"""What completions and chat share: the serving context and the response flow.

``ServingContext`` holds what every handler reads (the async engine, the tokenizer, the served
model name, the model's limits, the metrics, the chat-template renderer). ``respond`` runs a
``Generation`` and answers either as server-sent events (``data: {json}`` per chunk, then
``data: [DONE]``) or as one JSON body; in both a client that disconnects aborts the generation
at once: a stream is cancelled by Starlette when the disconnect arrives, and a non-streaming
request races its generation against the disconnect message. An engine that dies mid-generation
ends a stream with an error event in OpenAI's shape (then ``[DONE]``), and a body with 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response

from pieceworks.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from pieceworks.entrypoints.serve.errors import APIError, error_body
from pieceworks.entrypoints.serve.event_stream import EventStream
from pieceworks.entrypoints.serve.generation import ChoiceDelta, ChoiceResult, Generation
from pieceworks.entrypoints.serve.metrics import ServerMetrics
from pieceworks.entrypoints.serve.validation import ModelLimits

RETRY_AFTER_SECONDS = 1  # the hint a 503 gives: the queue moves on every engine step


@dataclasses.dataclass
class ServingContext:
    engine: AsyncLLMEngine
    tokenizer: Any
    model_name: str
    limits: ModelLimits
    metrics: ServerMetrics
    # (conversation, chat_template, add_generation_prompt, tools) -> prompt ids: ``LLM.chat``'s
    apply_chat_template: Callable[..., list[int]]
    # ``--tool-call-parser`` and ``--enable-auto-tool-choice`` (``tool_calls.py``)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False


@dataclasses.dataclass
class ResponseFormat:
    """How one endpoint shapes its answer: chunk and body builders over a shared header.

    A streamed chunk is the header, the chunk object's name and one choice; the stream writes
    the first three once per response (``chunk_prefix``), so ``chunk`` and ``first_chunks``
    give only each chunk's choice, as JSON text."""

    object_prefix: str  # "cmpl" or "chatcmpl": the id's prefix
    # one chunk per delta, or several (a delta that completes tool calls), or none
    chunk: Callable[[ChoiceDelta], list[str]]
    first_chunks: Callable[[int], list[str]]  # number of choices -> their opening chunks
    body: Callable[[dict[str, Any], list[ChoiceResult]], dict[str, Any]]


def usage(generation: Generation) -> dict[str, int]:
    completion = generation.num_generated_tokens
    prompt = generation.num_prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def respond(
    ctx: ServingContext, receive: Any, generation: Generation, fmt: ResponseFormat, body: Any
) -> Response:
    """Start ``generation`` (503 when full, 400 when refused) and answer as ``body`` asks;
    ``receive`` is the connection's ASGI receive (the body already read), for the disconnect."""
    try:
        await generation.start()
    except QueueFullError as error:
        raise APIError(503, str(error), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineDeadError as error:  # /health says the same; a restart is what helps
        raise APIError(503, str(error)) from None
    ctx.metrics.add_request(generation.num_prompt_tokens)
    header = {
        "id": f"{fmt.object_prefix}-{generation.request_id}",
        "created": int(time.time()),
        "model": ctx.model_name,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = ChunkStream(ctx, generation, fmt, header, include_usage)
        return EventStream(chunks, headers={"Cache-Control": "no-cache"})
    try:
        results = await _collect_unless_disconnected(receive, generation)
    except EngineDeadError as error:  # the engine died during the generation
        _count_finished(ctx, generation.results)
        raise APIError(503, str(error)) from None
    if results is None:  # nobody to answer; 499 is what proxies log for a client that left
        _count_finished(ctx, generation.results)
        return Response(status_code=499)
    _count_finished(ctx, results)
    payload = fmt.body(header, results)
    payload["usage"] = usage(generation)
    return JSONResponse(payload)


class ChunkStream:
    """A streamed response's writes, built when its generation has something to send: every
    choice's chunk since the last write joined (``take``), and after the last chunk the usage
    chunk (when asked) and ``data: [DONE]``, or the error event of an engine that died.
    ``EventStream`` calls ``take`` at the end of each engine turn that brought something
    (``listen``) and, for a writer that fell behind, once its last write went out."""

    def __init__(
        self,
        ctx: ServingContext,
        generation: Generation,
        fmt: ResponseFormat,
        header: dict[str, Any],
        include_usage: bool,
    ) -> None:
        self.ctx, self.generation = ctx, generation
        self.prefix = chunk_prefix(header, _chunk_object(fmt))
        self.chunk = fmt.chunk
        self.include_usage = include_usage
        self.opening = fmt.first_chunks(len(generation.choices))  # sent with the first write
        self.ended = False  # the last write was taken
        self.closed = False

    def listen(self, on_ready: Callable[[], None] | None) -> None:
        """Call ``on_ready`` at the end of every engine turn that brought this stream something."""
        self.generation.on_ready = on_ready

    def take(self) -> bytes:
        """What is ready to go out, as one write (``b""`` when nothing is)."""
        prefix, generation = self.prefix, self.generation
        if self.opening:
            choices, self.opening = self.opening, []
            events = [f"{prefix}{choice}]}}\n\n" for choice in choices]
        else:
            events = []
        try:
            for delta in generation.take():
                for choice in self.chunk(delta):
                    events.append(f"{prefix}{choice}]}}\n\n")
        except EngineDeadError as error:  # headers are sent: the stream ends with the error
            self.ended = True
            events.append(f"{_sse(error_body(503, str(error)))}data: [DONE]\n\n")
            return "".join(events).encode()
        if not generation.num_running:
            self.ended = True
            if self.include_usage:
                events.append(usage_chunk(prefix, usage(generation)))
            events.append("data: [DONE]\n\n")
        return "".join(events).encode()

    async def aclose(self) -> None:
        """Give back the generation's engine requests (aborting what still runs); count how
        each choice finished (a choice cut short counts as "abort"). Idempotent."""
        if not self.closed:
            self.closed = True
            self.generation.on_ready = None
            await self.generation.close()
            _count_finished(self.ctx, self.generation.results)


def _chunk_object(fmt: ResponseFormat) -> str:
    return "chat.completion.chunk" if fmt.object_prefix == "chatcmpl" else "text_completion"


# ``json.dumps(chunk, ensure_ascii=False)`` builds an encoder per call; all chunks share one.
encode_json = json.JSONEncoder(ensure_ascii=False).encode
# A JSON string literal of a str, as ``encode_json`` writes one (C, no encoder set up per call).
encode_string = json.encoder.encode_basestring  # type: ignore[attr-defined]


def encode_token_ids(token_ids: list[int]) -> str:
    """``encode_json(token_ids)`` of a list of ints, without setting up an encoder."""
    return f"[{', '.join(map(str, token_ids))}]"


def chunk_prefix(header: dict[str, Any], chunk_object: str) -> str:
    """``data: `` and a chunk's JSON up to its choice: the envelope each chunk of a stream
    shares (``header``: the id, created and model ``respond`` puts in it; then object), as
    ``encode_json`` writes it, from a template; a chunk is it, one choice and ``]}``."""
    return (
        f'data: {{"id": {encode_string(header["id"])}, "created": {header["created"]:d}, '
        f'"model": {encode_string(header["model"])}, "object": "{chunk_object}", "choices": ['
    )


def usage_chunk(prefix: str, counts: dict[str, int]) -> str:
    """The stream's usage event after ``prefix`` (``chunk_prefix``): no choices, ``counts``
    (``usage``), as ``encode_json`` writes the chunk, from a template."""
    return (
        f'{prefix}], "usage": {{"prompt_tokens": {counts["prompt_tokens"]:d}, '
        f'"completion_tokens": {counts["completion_tokens"]:d}, '
        f'"total_tokens": {counts["total_tokens"]:d}}}}}\n\n'
    )


def _sse(chunk: dict[str, Any]) -> str:
    return f"data: {encode_json(chunk)}\n\n"


def _count_finished(ctx: ServingContext, results: list[ChoiceResult]) -> None:
    for result in results:
        ctx.metrics.add_finished(result.finish_reason or "abort")


async def _collect_unless_disconnected(
    receive: Any, generation: Generation
) -> list[ChoiceResult] | None:
    """The finished choices, or None when the client disconnected first (the generation is
    then cancelled, which aborts its engine requests)."""
    work = asyncio.ensure_future(generation.collect())
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    if work.cancelled():
        return None
    return work.result()


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
