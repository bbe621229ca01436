"""``pieceworks serve`` with multi-step decode returns the tokens of single steps.

A server whose engine runs ``num_scheduler_steps=4`` answers completions, batched, streamed and
seeded, with exactly the token ids an offline ``LLM.generate`` with single steps gives (greedy and
seeded sampling; ``max_tokens`` 13 and 11, no multiple of 4); a streamed choice carries its tokens
in order, a run's 4 tokens together (one chunk, or one with a later run's when the stream falls
behind and its deltas are merged), and its usage counts every one.
Run: pytest tests/entrypoints/test_serve_multi_step.py
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402
from tests.entrypoints.server import running_server  # noqa: E402

MODEL = "llama-tiny"
NUM_STEPS = 4
MAX_TOKENS = 13
IDS = {"return_token_ids": True, "ignore_eos": True}


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


PROMPTS = random_prompts([3, 8, 13])


def make_llm(num_scheduler_steps: int) -> LLM:
    return LLM(
        MODEL,
        compilation_config={"level": 0},
        dtype="float32",
        max_num_seqs=4,
        num_scheduler_steps=num_scheduler_steps,
    )


@pytest.fixture(scope="module")
def server():
    """A multi-step server, and the single-step offline tokens: greedy for PROMPTS, then the
    two seeded completions (seed 7 and 8, as ``n=2, seed=7`` gives) of PROMPTS[0]."""
    single = make_llm(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = [out.outputs[0].token_ids for out in single.generate(PROMPTS, greedy)]
    seeded = [
        SamplingParams(temperature=1.0, max_tokens=11, ignore_eos=True, seed=seed)
        for seed in (7, 8)
    ]
    offline_seeded = [out.outputs[0].token_ids for out in single.generate(PROMPTS[:1] * 2, seeded)]
    single.shutdown()
    with running_server(make_llm(NUM_STEPS), MODEL) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield client, offline, offline_seeded


def test_batched_completions_equal_single_step_offline(server):
    client, offline, _ = server
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS, temperature=0.0, max_tokens=MAX_TOKENS, extra_body=IDS
    )
    assert [choice.token_ids for choice in response.choices] == offline
    assert [choice.finish_reason for choice in response.choices] == ["length"] * 3
    assert response.usage.completion_tokens == 3 * MAX_TOKENS


def test_streamed_completion_comes_in_order_a_run_at_a_time(server):
    client, offline, _ = server
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        extra_body=IDS,
    )
    chunks = list(stream)
    pieces = [chunk.choices[0].token_ids for chunk in chunks if chunk.choices]
    assert [token for piece in pieces for token in piece] == offline[2]
    # a run's tokens in one chunk (merged deltas can put more than one run in a chunk)
    assert max(len(piece) for piece in pieces) >= NUM_STEPS
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_seeded_choices_equal_single_step_offline(server):
    client, _, offline_seeded = server
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        n=2,
        seed=7,
        temperature=1.0,
        max_tokens=11,
        extra_body=IDS,
    )
    assert [choice.token_ids for choice in response.choices] == offline_seeded
