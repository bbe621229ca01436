"""CPU per streamed token of ``bench serve``'s load generator, against a stub server.

A load generator that needs more CPU per token than the server it measures sets the measured
time per token itself. This script starts a stub OpenAI server in a subprocess (plain asyncio:
every ``/v1/completions`` request gets ``--output-len`` chunks of one token each, in OpenAI's
shape, as fast as the socket takes them, then the usage chunk and ``[DONE]``), runs
``--num-prompts`` streamed requests, ``--concurrency`` at a time, and reports the client process's
CPU time (user + system) per streamed token and the tokens per second it reached:

- ``aiohttp``: ``pieceworks.benchmarks.serve.run_benchmark``, what ``bench serve`` runs;
- ``httpx``: the same requests read with httpx's ``AsyncClient.stream`` and ``aiter_lines``
  (the client ``bench serve`` used before), for comparison.

The stub shares the machine's cores with the client, so tokens per second is a lower bound of
the client's own rate; CPU per token is the figure to compare.

    python benchmarks/profile_client.py --concurrency 64 --num-prompts 256 --output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STUB = r"""
import asyncio, json, sys
port, num_tokens = int(sys.argv[1]), int(sys.argv[2])
chunk = {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion",
         "created": 1, "model": "m",
         "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None,
                      "token_ids": [1234]}]}
def framed(data):  # one HTTP/1.1 chunk
    return b"%x\r\n%s\r\n" % (len(data), data)
event = framed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
usage = {**chunk, "choices": [], "usage": {"prompt_tokens": 3}}
tail = framed(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n"
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for i in range(num_tokens):
                writer.write(event)
                if i % 4 == 3:
                    await writer.drain()
            writer.write(tail)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


async def _httpx_run(url: str, num_prompts: int, concurrency: int, output_len: int) -> int:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": output_len, "stream": True}
    counts: list[int] = []

    async def one(http: httpx.AsyncClient) -> None:
        async with gate, http.stream("POST", "/v1/completions", json=body) as response:
            tokens = 0
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    tokens += len(choices[0].get("token_ids") or [])
                    time.perf_counter()
            counts.append(tokens)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        await asyncio.gather(*(one(http) for _ in range(num_prompts)))
    return sum(counts)


async def _aiohttp_run(url: str, num_prompts: int, concurrency: int, output_len: int) -> int:
    from pieceworks.benchmarks.serve import BenchRequest, run_benchmark

    requests = [BenchRequest([1, 2, 3], 3, output_len) for _ in range(num_prompts)]
    results, _ = await run_benchmark(url, "m", requests, max_concurrency=concurrency)
    return sum(result.output_tokens for result in results)


def measure(client: str, url: str, args: argparse.Namespace) -> dict[str, float]:
    run = _aiohttp_run if client == "aiohttp" else _httpx_run
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    tokens = asyncio.run(run(url, args.num_prompts, args.concurrency, args.output_len))
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_us_per_token": cpu / tokens * 1e6, "tokens_per_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each client, alternating")
    parser.add_argument("--port", type=int, default=8931)
    args = parser.parse_args()
    stub = subprocess.Popen(
        [sys.executable, "-c", STUB, str(args.port), str(args.output_len)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stub.stdout is not None and stub.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{args.port}"
        rows: dict[str, list[dict[str, float]]] = {"aiohttp": [], "httpx": []}
        for _ in range(args.repeats):
            for client, runs in rows.items():
                runs.append(measure(client, url, args))
        for client, runs in rows.items():
            cpu = sorted(run["cpu_us_per_token"] for run in runs)
            rate = sorted(run["tokens_per_s"] for run in runs)
            print(
                f"{client:8s} CPU per token {cpu[len(cpu) // 2]:6.1f} us "
                f"(range {cpu[0]:.1f}-{cpu[-1]:.1f}); {rate[len(rate) // 2]:8.0f} tokens/s"
            )
    finally:
        stub.terminate()
        stub.wait()


if __name__ == "__main__":
    main()
