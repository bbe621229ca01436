"""``pieceworks serve`` end to end on llama-tiny (token-id prompts, level 0), via the openai client.

Proves: completions, streamed and not, return exactly the offline ``LLM.generate`` greedy tokens
and log-probabilities; ``n`` choices with a seed are reproducible; the model list, health and
Prometheus metrics answer; the shared-prefix and multi-turn ``bench serve`` workloads hit the
prefix cache exactly as often as their block counts say (a chat's later turns hit its earlier
answers' blocks too), read from ``/metrics``; the ``bench serve`` command writes its summary with
the load generator's share of a core; a chat request to a model without a chat
template, a wrong API key and a full engine are refused with their status and reason; a client
that leaves is aborted. Each
test runs with the engine in its own process and on a thread of the server. The load test and
the bad-request battery are in ``test_serve_load.py``.
Run: pytest tests/entrypoints/test_serve.py
"""

from __future__ import annotations

import asyncio
import json
import re
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
API_KEY = "test-key"
MAX_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
IDS = {"return_token_ids": True, "ignore_eos": True}


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


PROMPTS = random_prompts([3, 8, 13])


@pytest.fixture(scope="module", params=["engine_process", "engine_thread"])
def server(request):
    """One server per engine placement (its own process, as ``pieceworks serve`` runs it, or a
    thread of this process, ``--engine-in-process``), with the offline greedy tokens of PROMPTS
    from an ``LLM`` of the same arguments."""
    spec = EngineSpec(MODEL, {"level": 0}, {"dtype": "float32", "max_num_seqs": 4})
    llm = LLM(spec.model, compilation_config=spec.compilation_config, **spec.engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = [out.outputs[0] for out in llm.generate(PROMPTS, params)]
    offline = [output.token_ids for output in outputs]
    if request.param == "engine_process":
        llm.shutdown()
    engine = spec if request.param == "engine_process" else llm
    with running_server(engine, MODEL, api_key=API_KEY) as (url, ctx):
        yield url, ctx, offline, [output.logprobs for output in outputs]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0)


def test_completion_equals_offline(server, client):
    for prompt, expected in zip(PROMPTS, server[2]):
        response = client.completions.create(model=MODEL, prompt=prompt, extra_body=IDS, **GREEDY)
        choice = response.choices[0]
        assert choice.token_ids == expected
        assert choice.finish_reason == "length"
        assert response.usage.completion_tokens == MAX_TOKENS
        assert response.usage.prompt_tokens == len(prompt)


def test_batched_token_prompts_come_back_in_order(server, client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS, extra_body=IDS, **GREEDY)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [choice.token_ids for choice in response.choices] == server[2]


def test_streamed_completion_equals_offline(server, client):
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IDS,
        **GREEDY,
    )
    chunks = list(stream)
    tokens = [t for chunk in chunks if chunk.choices for t in chunk.choices[0].token_ids]
    assert tokens == server[2][1]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_seeded_choices_are_reproducible(server, client):
    def sample():
        response = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            n=3,
            seed=7,
            temperature=1.0,
            max_tokens=8,
            extra_body=IDS,
        )
        return [choice.token_ids for choice in response.choices]

    first = sample()
    assert len(first) == 3 and all(len(tokens) == 8 for tokens in first)
    assert sample() == first
    assert len({tuple(tokens) for tokens in first}) > 1  # seed + i per choice: they differ


def test_models_health_metrics(server, client):
    url, ctx = server[:2]
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200  # open without the key
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, extra_body=IDS)
    text = httpx.get(f"{url}/metrics").text
    for phase in ("queue", "prefill"):  # the engine's own times, from its stats
        count = re.search(rf"^pieceworks:request_{phase}_time_seconds_count\S* (\S+)$", text, re.M)
        assert count is not None and float(count[1]) >= 1
    for name in (
        "pieceworks:num_requests_running",
        "pieceworks:num_requests_waiting",
        "pieceworks:kv_cache_usage_perc",
        "pieceworks:time_to_first_token_seconds_bucket",
        "pieceworks:time_per_output_token_seconds_bucket",
        "pieceworks:generation_tokens_total",
        "pieceworks:prefix_cache_queries_total",
        "pieceworks:prefix_cache_hits_total",
    ):
        assert name in text


def test_chat_without_template_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_wrong_or_missing_api_key(server):
    url = server[0]
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.completions.create(model=MODEL, prompt=[1, 2], max_tokens=1)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2]})
    assert response.status_code == 401


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=[1, 2], max_tokens=1)


def test_full_engine_answers_503_with_retry_after(server):
    url, ctx = server[:2]
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def run() -> tuple[httpx.Response, list[int]]:
        saved, ctx.engine.max_live_requests = ctx.engine.max_live_requests, 1
        try:
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
                body = {"prompt": [1, 2, 3], "max_tokens": 200, "stream": True, **IDS}
                async with http.stream("POST", "/v1/completions", json=body) as stream:
                    lines = stream.aiter_lines()
                    await anext(lines)  # the first token: the one seat is taken
                    refused = await http.post("/v1/completions", json={"prompt": [1], **IDS})
            return refused, []
        finally:
            ctx.engine.max_live_requests = saved

    refused, _ = asyncio.run(run())
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == "1"
    assert "retry later" in refused.json()["error"]["message"]


def test_bench_serve_against_the_server(server, tmp_path):
    from pieceworks.benchmarks.serve import plot_serve, run_benchmark, sample_requests, summarize

    url = server[0]
    requests = sample_requests(8, input_len=6, output_len=5, range_ratio=0.5, seed=3)
    assert all(3 <= r.prompt_len <= 9 and 2 <= r.output_len <= 7 for r in requests)
    results, duration = asyncio.run(
        run_benchmark(url, MODEL, requests, request_rate=200.0, max_concurrency=3, api_key=API_KEY)
    )
    summary = summarize(results, duration)
    assert summary["completed"] == 8, summary["errors"]
    assert summary["total_output_tokens"] == sum(r.output_len for r in requests)
    assert [r.output_tokens for r in results] == [r.output_len for r in requests]
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        stats = summary[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    plot_serve(tmp_path / "serve.png", results, "test")
    assert (tmp_path / "serve.png").stat().st_size > 0
    # The command: its JSON holds the summary and the load generator's share of a core.
    from pieceworks.entrypoints.cli import main

    argv = ["bench", "serve", "--base-url", url, "--model", MODEL, "--api-key", API_KEY,
            "--num-prompts", "4", "--input-len", "4", "--output-len", "3",
            "--output-json", str(tmp_path / "serve.json")]  # fmt: skip
    assert main(argv) == 0
    written = json.loads((tmp_path / "serve.json").read_text())
    assert written["completed"] == 4 and 0.0 < written["client_cpu_share"] < 4.0


def test_prefix_cache_workloads_report_their_hit_rate(server):
    from pieceworks.benchmarks.serve import run_benchmark, summarize
    from pieceworks.benchmarks.serve_workloads import (
        engine_phase_means,
        engine_phase_totals,
        multi_turn_chats,
        prefix_cache_counts,
        prefix_cache_hit_rate,
        run_multi_turn,
        shared_prefix_requests,
    )

    url = server[0]
    # 6 prompts of 32 shared + 4 own tokens, one at a time: each after the first finds the
    # prefix's 2 blocks of 16 (its own last block is computed): 5 * 32 of 6 * 36 tokens.
    requests = shared_prefix_requests(6, prefix_len=32, input_len=4, output_len=3, seed=5)
    before = prefix_cache_counts(url, API_KEY)
    phases_before = engine_phase_totals(url, API_KEY)
    results, duration = asyncio.run(
        run_benchmark(url, MODEL, requests, max_concurrency=1, api_key=API_KEY)
    )
    rate = prefix_cache_hit_rate(before, prefix_cache_counts(url, API_KEY))
    assert summarize(results, duration)["completed"] == 6
    assert (rate["prefix_cache_hits"], rate["prefix_cache_queries"]) == (160, 216)
    phases = engine_phase_means(phases_before, engine_phase_totals(url, API_KEY))
    ttft_ms = [result.ttft_s * 1e3 for result in results]
    # one request at a time: queued and prefilling in the engine, within its time to first token
    assert 0 <= phases["engine_queue_ms"] + phases["engine_prefill_ms"] < max(ttft_ms)
    # One chat of 3 turns (10-token questions, 8-token answers): prompts of 10, 28 and 46
    # tokens. Turn 2 finds turn 1's first block (10 prompt + 6 generated tokens), turn 3 the
    # first 2 blocks of turn 2's 35 KV tokens: 16 + 32 of 84.
    chats = multi_turn_chats(3, num_turns=3, input_len=10, output_len=8, seed=6)
    before = prefix_cache_counts(url, API_KEY)
    results, _ = asyncio.run(run_multi_turn(url, MODEL, chats, api_key=API_KEY))
    rate = prefix_cache_hit_rate(before, prefix_cache_counts(url, API_KEY))
    assert [r.prompt_len for r in results] == [10, 28, 46]
    assert (rate["prefix_cache_hits"], rate["prefix_cache_queries"]) == (48, 84)


def test_non_streaming_client_that_leaves_is_aborted(server):
    url, ctx = server[:2]
    aborted_before = ctx.engine.stats.num_aborted
    body = {"prompt": [1, 2, 3], "max_tokens": 1500, **IDS}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=0.5)
    deadline = time.monotonic() + 10
    while ctx.engine.stats.num_aborted == aborted_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ctx.engine.stats.num_aborted == aborted_before + 1
    while ctx.engine.stats.num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ctx.engine.stats.num_free_blocks == ctx.engine.stats.num_blocks


def test_logprobs_equal_offline(server, client):
    offline = server[3][2]  # per token: {token id: Logprob} with the top 2 and the chosen one
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], logprobs=2, extra_body=IDS, **GREEDY
    )
    choice = response.choices[0]
    assert choice.token_ids == server[2][2]
    logprobs = choice.logprobs
    assert logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    for i, token_id in enumerate(choice.token_ids):
        assert logprobs.token_logprobs[i] == pytest.approx(offline[i][token_id].logprob, abs=1e-5)
        top = logprobs.top_logprobs[i]
        assert len(top) == 2
        expected = {f"token_id:{t}": lp.logprob for t, lp in offline[i].items() if lp.rank <= 2}
        assert top == pytest.approx(expected, abs=1e-5)
