"""``pieceworks serve`` under load on CPU, then every kind of bad request, on one live server.

Proves: 64 concurrent streaming clients, every tenth disconnecting after its second chunk, share
the engine (in its own process, as ``pieceworks serve`` runs it); each client that stays gets
exactly its offline greedy tokens; the disconnected requests are aborted (the KV blocks all
return, nothing is left running); ``/health`` answers 200 throughout. Then each bad request
(malformed JSON, wrong types, a prompt too long, max_tokens <= 0, bad sampling values, invalid
UTF-8, an oversized body, ids outside the vocabulary, an empty prompt, unsupported fields) gets
400 with its reason, and the server still serves a good request after.
Loopback only; bounded in count (64 requests, 12 tokens each) and time (60 s timeouts).
Run: pytest tests/entrypoints/test_serve_load.py
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from pieceworks.engine.core_process import EngineSpec  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402
from tests.entrypoints.server import running_server  # noqa: E402

MODEL = "llama-tiny"
NUM_CLIENTS = 64
MAX_TOKENS = 12
# Long enough that a client that leaves after two tokens cannot be served to the end before the
# server notices it left (the engine steps in its own process while the server is busy).
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server():
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 24, (NUM_CLIENTS,), generator=generator).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
    engine_args = {"dtype": "float32", "max_num_seqs": 16, "max_model_len": MAX_MODEL_LEN}
    spec = EngineSpec(MODEL, {"level": 0}, engine_args)
    llm = LLM(MODEL, compilation_config=spec.compilation_config, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    llm.shutdown()
    with running_server(spec, MODEL, max_body_bytes=MAX_BODY_BYTES) as (url, ctx):
        yield url, ctx, prompts, offline


async def _client(client, prompt: list[int], disconnect: bool) -> list[int] | None:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        # A client that will leave asks for far more than it reads, so it leaves mid-generation.
        max_tokens=MAX_MODEL_LEN - len(prompt) if disconnect else MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    tokens: list[int] = []
    async for chunk in stream:
        tokens.extend(chunk.choices[0].token_ids)
        if disconnect and len(tokens) >= 2:
            await stream.close()  # the client goes away mid-stream
            return None
    return tokens


async def _poll_health(url: str, stop: asyncio.Event) -> list[tuple[int, float]]:
    answers = []
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            start = time.perf_counter()
            response = await http.get(f"{url}/health")
            answers.append((response.status_code, time.perf_counter() - start))
            await asyncio.sleep(0.05)
    return answers


def test_64_streaming_clients_a_tenth_disconnecting(server):
    url, ctx, prompts, offline = server
    num_blocks = ctx.engine.stats.num_blocks
    assert ctx.engine.stats.num_free_blocks == num_blocks
    disconnects = [i % 10 == 5 for i in range(NUM_CLIENTS)]

    async def run():
        stop = asyncio.Event()
        health = asyncio.ensure_future(_poll_health(url, stop))
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        results = await asyncio.wait_for(
            asyncio.gather(*(_client(client, p, d) for p, d in zip(prompts, disconnects))), 120
        )
        stop.set()
        await client.close()
        return results, await health

    results, health = asyncio.run(run())
    for index, (tokens, disconnected) in enumerate(zip(results, disconnects)):
        if disconnected:
            assert tokens is None
        else:
            assert tokens == offline[index], f"client {index}"
    assert health and all(status == 200 for status, _ in health)
    deadline = time.monotonic() + 10  # aborts land on the engine loop's next turn
    while time.monotonic() < deadline:
        stats = ctx.engine.stats
        if stats.num_free_blocks == num_blocks and not stats.num_running and not stats.num_waiting:
            break
        time.sleep(0.05)
    assert ctx.engine.stats.num_free_blocks == num_blocks
    assert ctx.engine.num_live_requests == 0
    assert ctx.engine.stats.num_aborted == sum(disconnects)  # aborted, not run to the end
    metrics = httpx.get(f"{url}/metrics").text
    aborted = f'request_success_total{{finished_reason="abort",model_name="{MODEL}"}} '
    assert f"{aborted}{float(sum(disconnects))}" in metrics


def _post(url: str, content: bytes) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{url}/v1/completions", content=content, headers=headers, timeout=30)


BAD_REQUESTS = [
    ("malformed JSON", b'{"prompt": [1, 2', "not valid JSON"),
    ("not an object", b"[1, 2, 3]", "must be a JSON object"),
    ("prompt of the wrong type", b'{"prompt": {"a": 1}}', "invalid field 'prompt"),
    ("max_tokens of the wrong type", b'{"prompt": [1], "max_tokens": "ten"}', "'max_tokens'"),
    ("stream of the wrong type", b'{"prompt": [1], "stream": [true]}', "'stream'"),
    ("max_tokens = 0", b'{"prompt": [1], "max_tokens": 0}', "max_tokens=0 must be at least 1"),
    ("max_tokens < 0", b'{"prompt": [1], "max_tokens": -3}', "max_tokens=-3 must be at least 1"),
    ("temperature < 0", b'{"prompt": [1], "temperature": -1}', "'temperature'"),
    ("top_p = 0", b'{"prompt": [1], "top_p": 0}', "'top_p'"),
    ("top_p > 1", b'{"prompt": [1], "top_p": 1.5}', "'top_p'"),
    ("n = 0", b'{"prompt": [1], "n": 0}', "'n'"),
    (
        "prompt too long",
        b'{"prompt": [1, 2, 3], "max_tokens": %d}' % (MAX_MODEL_LEN - 2),
        "maximum context length",
    ),
    (
        "ids outside the vocabulary",
        b'{"prompt": [1, 256]}',
        "outside this model's vocabulary [0, 256)",
    ),
    ("empty prompt", b'{"prompt": []}', "the prompt is empty"),
    ("text without a tokenizer", b'{"prompt": "hello"}', "no tokenizer"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    ("unsupported penalty", b'{"prompt": [1], "presence_penalty": 0.5}', "not supported"),
    ("oversized body", b'{"prompt": [' + b"1, " * 30_000 + b"1]}", "larger than the 65536 bytes"),
]


@pytest.mark.parametrize(
    "content, reason", [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS]
)
def test_bad_request_is_400_with_its_reason(server, content, reason):
    response = _post(server[0], content)
    assert response.status_code == 400, response.text
    assert reason in response.json()["error"]["message"]


def test_server_still_serves_after_the_battery(server):
    url, ctx, prompts, offline = server
    body = {"prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0.0}
    body |= {"return_token_ids": True, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.json()["choices"][0]["token_ids"] == offline[0]
    assert httpx.get(f"{url}/health").status_code == 200
