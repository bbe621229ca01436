"""Breakable CUDA graphs through the engine: level 0 capture of llama-125m's eager forward (bf16).

``CUDAGraphWrapper`` captures each segment between attention ops as a CUDA graph and runs the
attention op eagerly between replays. Proves on a GPU: the segment counters are exact (12 layers:
13 segments per capture size) and the first greedy tokens of a mixed, queued workload (more
prompts than max_num_seqs, a prompt chunked by the token budget) equal eager's for
``breakable_piecewise`` and ``breakable``. Padding changes GEMM shapes, so bf16 near-ties in a
random-weight model may flip later tokens: the first four are compared, as for the compiled modes.
Run on a GPU machine: pytest -m gpu tests/engine/test_breakable_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.core.counters import compilation_counter
from pieceworks.engine.llm import LLM
from pieceworks.platforms import current_platform
from pieceworks.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
NUM_COMPARED_TOKENS = 4
NUM_LAYERS = 12  # llama-125m
NUM_SIZES, NUM_DECODE_SIZES = 4, 3  # max_num_seqs 4: sizes 1, 2, 4, 8; FULL decode for <= 4


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
    llm.shutdown()
    del llm
    gc.collect()
    current_platform().empty_cache()
    return tokens


@pytest.fixture(scope="module")
def batch() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = (3, 9, 17, 70, 5, 2)
    return [torch.randint(0, 50272, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def eager_tokens(batch) -> list[list[int]]:
    return greedy_tokens("eager", batch)


def test_breakable_piecewise_segments_and_tokens(batch, eager_tokens):
    segments = NUM_SIZES * (NUM_LAYERS + 1)  # 12 attention calls end 12 segments, plus the last
    with compilation_counter.expect(
        num_graphs_seen=0,
        num_cudagraph_captured=segments,
        num_breakable_segments_captured=segments,
    ):
        tokens = greedy_tokens("breakable_piecewise", batch)
    assert tokens == eager_tokens


def test_breakable_full_decode_and_segments_and_tokens(batch, eager_tokens):
    segments = NUM_SIZES * (NUM_LAYERS + 1)
    # FULL decode graphs, each with its decode tail and masked tail, and the segments
    with compilation_counter.expect(
        num_cudagraph_captured=3 * NUM_DECODE_SIZES + segments,
        num_decode_tails_captured=2 * NUM_DECODE_SIZES,
        num_breakable_segments_captured=segments,
    ):
        tokens = greedy_tokens("breakable", batch)
    assert tokens == eager_tokens
