"""Llama through the engine with real device graphs: greedy tokens equal across graph modes (bf16).

Graph modes NONE (level 3, no graphs), PIECEWISE and FULL_AND_PIECEWISE run the same compiled
code, so the first greedy tokens of several prompts must agree; a mixed, queued workload (more
prompts than max_num_seqs, a prompt chunked by the token budget) exercises padding and dispatch.
Multi-step decode (``num_scheduler_steps=8``, FULL decode graphs replayed 8 times per host round
trip on inputs the device advances) gives every token of single steps (float32: no near-ties),
greedy and seeded, with ``max_tokens`` no multiple of 8.
Greedy decode steps sampled in captured decode tails (bf16, one and eight steps per round trip)
give the tokens of the same engine sampling by launches, token for token: the same kernels on
the same rows.
Run on a GPU machine: pytest -m gpu tests/engine/test_engine_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.engine.llm import LLM
from pieceworks.platforms import current_platform
from pieceworks.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
NUM_COMPARED_TOKENS = 4  # bf16 near-ties in a random-weight model may flip later tokens


def greedy_tokens(mode: str, batch: list[list[int]]) -> list[list[int]]:
    llm = LLM(
        "llama-125m",
        compilation_config=compilation_for_mode(mode),
        dtype="bfloat16",
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = [out.outputs[0].token_ids[:NUM_COMPARED_TOKENS] for out in llm.generate(batch, params)]
    del llm
    gc.collect()
    current_platform().empty_cache()
    return tokens


def test_llama_bf16_tokens_equal_across_graph_modes():
    generator = torch.Generator().manual_seed(0)
    batch = [
        torch.randint(0, 50272, (n,), generator=generator).tolist() for n in (3, 9, 17, 70, 5, 2)
    ]
    reference = greedy_tokens("compiled", batch)
    assert greedy_tokens("piecewise", batch) == reference
    assert greedy_tokens("full_and_piecewise", batch) == reference


def generated_tokens(num_scheduler_steps: int, batch: list[list[int]]) -> list[list[int]]:
    llm = LLM(
        "llama-125m",
        compilation_config=compilation_for_mode("full_and_piecewise"),
        dtype="float32",
        max_num_seqs=4,
        num_scheduler_steps=num_scheduler_steps,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=3),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=26, ignore_eos=True, seed=5),
    ]
    tokens = [out.outputs[0].token_ids for out in llm.generate(batch, params)]
    llm.shutdown()
    del llm
    gc.collect()
    current_platform().empty_cache()
    return tokens


def test_multi_step_decode_gives_the_single_step_tokens():
    generator = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, 50272, (n,), generator=generator).tolist() for n in (4, 11, 7, 20)]
    single = generated_tokens(1, batch)
    assert [len(tokens) for tokens in single] == [21, 30, 9, 26]
    assert generated_tokens(8, batch) == single


def tail_tokens(num_scheduler_steps: int, tails: bool, batch: list[list[int]]) -> tuple:
    """Greedy tokens of ``batch`` (bf16) and how many runs the decode tails sampled."""
    llm = LLM(
        "llama-125m",
        compilation_config=compilation_for_mode("full_and_piecewise"),
        dtype="bfloat16",
        max_num_seqs=4,
        num_scheduler_steps=num_scheduler_steps,
    )
    runner = llm.engine.runner
    if not tails:
        runner.graphs.decode_tail_descriptors = set()
    runs = []
    run_tails = runner._run_decode_tails
    runner._run_decode_tails = lambda step, n, grammar=None: (
        runs.append(n) or run_tails(step, n, grammar)
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (21, 30, 9, 26)
    ]
    tokens = [out.outputs[0].token_ids for out in llm.generate(batch, params)]
    llm.shutdown()
    del llm
    gc.collect()
    current_platform().empty_cache()
    return tokens, len(runs)


@pytest.mark.parametrize("num_scheduler_steps", [1, 8])
def test_decode_tails_give_the_tokens_of_launches(num_scheduler_steps):
    generator = torch.Generator().manual_seed(2)
    batch = [torch.randint(0, 50272, (n,), generator=generator).tolist() for n in (4, 11, 7, 20)]
    launched, no_runs = tail_tokens(num_scheduler_steps, False, batch)
    captured, num_runs = tail_tokens(num_scheduler_steps, True, batch)
    assert no_runs == 0 and num_runs > 0
    assert captured == launched
