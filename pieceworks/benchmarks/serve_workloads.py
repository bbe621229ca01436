"""``bench serve``'s prefix-caching workloads and the server's prefix-cache hit rate.

``shared_prefix_requests``: every request is one common "system prompt" of ``prefix_len`` random
tokens plus a short question of its own (``input_len`` tokens), so all but the first find the
prefix in the server's prefix cache. ``multi_turn_chats`` / ``run_multi_turn``: chats whose every
turn resends the whole history (the earlier questions and the answers the server gave) plus a
new question, one turn after the other, so each turn finds the blocks of the turns before it,
generated tokens included. ``prefix_cache_counts`` reads the server's ``prefix_cache_queries``
and ``prefix_cache_hits`` counters from ``/metrics``; their growth over a run is its hit rate.
``engine_phase_totals`` reads its ``request_queue_time`` and ``request_prefill_time`` histograms,
whose growth gives the mean time a request spent queued and prefilling in the engine.
Sending and timing are ``serve.py``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re
import time
from typing import Any

import numpy as np

from pieceworks.benchmarks.serve import BenchRequest, ClientSession, RequestResult, send_request

WORKLOADS = ("random", "shared-prefix", "multi-turn")


def shared_prefix_requests(
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    vocab_size: int = 256,
    seed: int = 0,
) -> list[BenchRequest]:
    """One shared prefix of ``prefix_len`` tokens, then ``input_len`` tokens per request."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [
        BenchRequest(prefix + [rng.randrange(vocab_size) for _ in range(input_len)],
                     prefix_len + input_len, output_len)
        for _ in range(num_prompts)
    ]  # fmt: skip


@dataclasses.dataclass
class Chat:
    """A chat's questions (token ids), one per turn, each answered with ``output_len`` tokens."""

    questions: list[list[int]]
    output_len: int


def multi_turn_chats(
    num_prompts: int,
    num_turns: int,
    input_len: int,
    output_len: int,
    vocab_size: int = 256,
    seed: int = 0,
) -> list[Chat]:
    """``num_prompts // num_turns`` chats (at least one) of ``num_turns`` questions."""
    if num_turns < 1:
        raise ValueError(f"num_turns={num_turns} must be at least 1")
    rng = random.Random(seed)
    return [
        Chat([[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_turns)],
             output_len)
        for _ in range(max(num_prompts // num_turns, 1))
    ]  # fmt: skip


async def run_multi_turn(
    base_url: str,
    model: str,
    chats: list[Chat],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    api_key: str | None = None,
    seed: int = 0,
    extra_body: dict[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run every chat, its turns one after another (each prompt: the history so far plus the
    next question); chats start at ``request_rate`` and at most ``max_concurrency`` run at once.
    Results per turn, chat by chat, and the wall seconds of the whole run."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = np.random.default_rng(seed)
    results: list[list[RequestResult]] = [[] for _ in chats]

    async def one_chat(chat: Chat, chat_results: list[RequestResult]) -> None:
        history: list[int] = []
        for question in chat.questions:
            prompt = history + question
            result = RequestResult(len(prompt))
            chat_results.append(result)
            request = BenchRequest(prompt, len(prompt), chat.output_len)
            try:
                await send_request(http, model, request, result, extra_body=extra_body)
            except Exception as error:  # the chat ends; its other turns are not sent
                result.error = repr(error)
            if not result.success:
                return
            history = prompt + result.output_token_ids

    async def gated(chat: Chat, chat_results: list[RequestResult]) -> None:
        if gate is None:
            await one_chat(chat, chat_results)
        else:
            async with gate:
                await one_chat(chat, chat_results)

    async with ClientSession(base_url, api_key, max_concurrency or len(chats) or 1) as http:
        start = time.perf_counter()
        tasks = []
        for chat, chat_results in zip(chats, results):
            tasks.append(asyncio.ensure_future(gated(chat, chat_results)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return [result for chat_results in results for result in chat_results], duration


def _metrics_text(base_url: str, api_key: str | None) -> str | None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return None


def _series_total(text: str, name: str) -> float | None:
    """The sum over labels of the samples named ``<prefix>:name``; None if there are none."""
    values = re.findall(rf"^\S*:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return sum(float(value) for value in values) if values else None


def prefix_cache_counts(base_url: str, api_key: str | None = None) -> tuple[float, float] | None:
    """The server's (queried, hit) prefix-cache token counters; None if it exports none."""
    text = _metrics_text(base_url, api_key)
    if text is None:
        return None
    queries = _series_total(text, "prefix_cache_queries_total")
    hits = _series_total(text, "prefix_cache_hits_total")
    return None if queries is None or hits is None else (queries, hits)


# The engine's request phases (vLLM's request_queue_time and request_prefill_time histograms).
ENGINE_PHASES = ("queue", "prefill")


def engine_phase_totals(base_url: str, api_key: str | None = None) -> dict[str, float] | None:
    """The server's ``request_<phase>_time_seconds`` sums and counts; None if it exports none."""
    text = _metrics_text(base_url, api_key)
    if text is None:
        return None
    totals = {}
    for phase in ENGINE_PHASES:
        for part in ("sum", "count"):
            value = _series_total(text, f"request_{phase}_time_seconds_{part}")
            if value is None:
                return None
            totals[f"{phase}_{part}"] = value
    return totals


def engine_phase_means(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float | None]:
    """Each phase's mean over the run in ms (``engine_queue_ms``, ``engine_prefill_ms``): the part
    of the time to first token that the engine spent queueing and prefilling; None where the
    server exports no such histogram or no request went through the phase."""
    means: dict[str, float | None] = {}
    for phase in ENGINE_PHASES:
        key = f"engine_{phase}_ms"
        means[key] = None
        if before is not None and after is not None:
            count = after[f"{phase}_count"] - before[f"{phase}_count"]
            if count > 0:
                means[key] = (after[f"{phase}_sum"] - before[f"{phase}_sum"]) / count * 1e3
    return means


def prefix_cache_hit_rate(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> dict[str, Any]:
    """The run's queried and hit tokens and their ratio (None where the server has no counters)."""
    if before is None or after is None:
        return {"prefix_cache_queries": None, "prefix_cache_hits": None,
                "prefix_cache_hit_rate": None}  # fmt: skip
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {
        "prefix_cache_queries": int(queries),
        "prefix_cache_hits": int(hits),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }
