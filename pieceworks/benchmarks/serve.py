"""``bench serve``: load a running OpenAI-compatible server and measure it (benchmark_serving).

Requests go to ``/v1/completions`` as streams, either at a Poisson rate (``request_rate``
requests per second; ``inf`` sends them all at once) or with a fixed number in flight
(``max_concurrency``), or both. Prompts are random token ids (``input_len`` tokens, or lengths
sampled uniformly within ``range_ratio`` of it) or lines of a text file; every request asks for
``output_len`` tokens (sampled the same way) with ``ignore_eos`` so the lengths hold. Per request
it records the time to the first token (TTFT), the gaps between streamed tokens (ITL) and the
time per output token after the first (TPOT); the summary gives their mean, p50, p90 and p99 in
milliseconds and the request, output-token and total-token throughput, and, when the caller
adds them (``serve_workloads.py``, which also holds the shared-prefix and multi-turn workloads),
the server's prefix-cache hit rate over the run. Only the client side is here: the server is
whatever answers at ``base_url``.

The client is aiohttp (as vLLM's ``benchmark_serving``), all streams on one event loop: it reads
a streamed token for about 15 us of CPU where httpx's ``aiter_lines`` took about 90 us
(``benchmarks/profile_client.py``: 64 streams from a stub server on a 2-core machine). A client
on one core that needs 90 us a token reads about 11,000 tokens a second, less than a small
model's batch of 64 streams makes (64 tokens a 0.9 ms step: 71,000 a second), so the client, not
the server, would set the measured time per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
# From this share of one core busy the load generator may be what a run measured (its one event
# loop reads every stream): the summary says so.
CLIENT_BUSY_WARNING = 0.8


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def _lengths(mean: int, range_ratio: float, count: int, rng: random.Random) -> list[int]:
    low, high = max(int(mean * (1 - range_ratio)), 1), max(int(mean * (1 + range_ratio)), 1)
    return [rng.randint(low, high) for _ in range(count)]


def sample_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 256,
    dataset_path: str | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random token prompts (ids below ``vocab_size``), or the lines of ``dataset_path``."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1)")
    rng = random.Random(seed)
    output_lens = _lengths(output_len, range_ratio, num_prompts, rng)
    if dataset_path is not None:
        lines = [line.strip() for line in Path(dataset_path).read_text().splitlines()]
        lines = [line for line in lines if line]
        if not lines:
            raise ValueError(f"{dataset_path} has no non-empty lines to use as prompts")
        prompts = [lines[i % len(lines)] for i in range(num_prompts)]
        # Words stand in for tokens until the server's usage gives the real count.
        return [BenchRequest(p, len(p.split()), n) for p, n in zip(prompts, output_lens)]
    input_lens = _lengths(input_len, range_ratio, num_prompts, rng)
    return [
        BenchRequest([rng.randrange(vocab_size) for _ in range(n)], n, m)
        for n, m in zip(input_lens, output_lens)
    ]


class ClientSession:
    """An aiohttp session for ``base_url``: ``max_connections`` connections (kept alive), the
    API key's header, no time limit; ``url(path)`` is the full URL of an API path."""

    def __init__(self, base_url: str, api_key: str | None, max_connections: int) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.max_connections = max_connections

    def url(self, path: str) -> str:
        return self.base_url + path

    async def __aenter__(self) -> Any:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_connections),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()


async def _send(
    http: ClientSession, path: str, body: dict[str, Any], result: RequestResult
) -> None:
    """Stream one completion, timing its first token and the gaps between tokens."""
    start = last = time.perf_counter()
    async with http.session.post(http.url(path), json=body) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return
        async for raw in response.content:  # one line at a time
            line = raw.rstrip(b"\r\n")
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):  # the last chunk: the server's own count of prompt tokens
                result.prompt_len = chunk["usage"]["prompt_tokens"]
            choices = chunk.get("choices") or [{}]
            token_ids = choices[0].get("token_ids") or []
            num_tokens = len(token_ids)
            if not num_tokens:
                continue
            result.output_token_ids.extend(token_ids)
            now = time.perf_counter()
            if result.output_tokens == 0:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            result.output_tokens += num_tokens
    result.latency_s = time.perf_counter() - start
    result.success = result.output_tokens > 0


async def send_request(
    http: ClientSession,
    model: str,
    request: BenchRequest,
    result: RequestResult,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
) -> None:
    """Stream ``request`` as a greedy completion into ``result`` (``extra_body``'s fields added
    to the request, e.g. a ``response_format``)."""
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        **(extra_body or {}),
    }
    await _send(http, "/v1/completions", body, result)


async def run_benchmark(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    api_key: str | None = None,
    ignore_eos: bool = True,
    seed: int = 0,
    extra_body: dict[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request as the rate and concurrency allow; results in request order and the
    wall seconds from the first send to the last answer."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = np.random.default_rng(seed)
    results = [RequestResult(r.prompt_len) for r in requests]

    async def one(request: BenchRequest, result: RequestResult) -> None:
        try:
            if gate is None:
                await send_request(http, model, request, result, ignore_eos, extra_body)
            else:
                async with gate:
                    await send_request(http, model, request, result, ignore_eos, extra_body)
        except Exception as error:  # a failed request is a result, not the end of the run
            result.error = repr(error)

    async with ClientSession(base_url, api_key, max_concurrency or len(requests) or 1) as http:
        start = time.perf_counter()
        tasks = []
        for request, result in zip(requests, results):
            tasks.append(asyncio.ensure_future(one(request, result)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))  # Poisson arrivals
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    array = np.asarray(values) * 1000.0
    stats = {"mean": float(array.mean())}
    stats.update({f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES})
    return stats


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """Throughput and latency percentiles (milliseconds) over the successful requests."""
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    return {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_token_throughput": output_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s
        if duration_s
        else 0.0,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "ttft_ms": _stats_ms([r.ttft_s for r in done]),
        "tpot_ms": _stats_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itl_s]),
        "e2el_ms": _stats_ms([r.latency_s for r in done]),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """vLLM's benchmark_serving printout: counts, throughput, then each latency's percentiles."""
    lines = [
        f"Successful requests:        {summary['completed']} of {summary['num_requests']}",
        f"Benchmark duration (s):     {summary['duration_s']:.2f}",
        f"Request throughput (req/s): {summary['request_throughput']:.2f}",
        f"Output token throughput:    {summary['output_token_throughput']:.1f} tok/s",
        f"Total token throughput:     {summary['total_token_throughput']:.1f} tok/s",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        stats = summary[key]
        cells = "  ".join(f"p{p} {stats[f'p{p}']:.2f}" for p in PERCENTILES)
        lines.append(f"{label:5} (ms): mean {stats['mean']:.2f}  {cells}")
    if summary.get("prefix_cache_hit_rate") is not None:
        lines.append(
            f"Prefix cache hit rate:      {summary['prefix_cache_hit_rate']:.1%} "
            f"({summary['prefix_cache_hits']} of {summary['prefix_cache_queries']} tokens)"
        )
    queue_ms, prefill_ms = summary.get("engine_queue_ms"), summary.get("engine_prefill_ms")
    if queue_ms is not None and prefill_ms is not None:  # the server's own split of TTFT
        lines.append(f"Engine queue / prefill (ms): mean {queue_ms:.2f} / {prefill_ms:.2f}")
    share = summary.get("client_cpu_share")
    if share is not None:
        lines.append(f"Load generator CPU:         {share:.0%} of one core")
        if share >= CLIENT_BUSY_WARNING:
            lines.append(
                "warning: the load generator was busy most of the run, so these times may be its "
                "own; run fewer streams per process or a faster client machine"
            )
    if summary["errors"]:
        lines.append(f"errors: {summary['errors']}")
    return "\n".join(lines)


def plot_serve(path: Path, results: list[RequestResult], title: str) -> None:
    """Cumulative distributions of TTFT, TPOT and ITL (milliseconds) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.success]
    series = {
        "TTFT": [r.ttft_s for r in done],
        "TPOT": [t for r in done if (t := r.tpot_s) is not None],
        "ITL": [gap for r in done for gap in r.itl_s],
    }
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, (name, values) in zip(axes, series.items()):
        data = np.sort(np.asarray(values) * 1000.0)
        if len(data):
            axis.plot(data, np.arange(1, len(data) + 1) / len(data))
        axis.set_xlabel(f"{name} (ms)")
        axis.set_ylabel("share of samples")
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
