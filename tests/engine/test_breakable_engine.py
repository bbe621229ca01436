"""Breakable graphs through the engine: level 0 captures the eager forward, no compile at all.

Proves, for Llama (attention only) and a Bamba hybrid (Mamba2 and attention layers): the greedy
tokens of ``breakable`` (level 0, FULL decode graphs + breakable mixed graphs) and
``breakable_piecewise`` (level 0, breakable graphs for every batch) equal eager (level 0, no
graphs) and level 3 FULL_AND_PIECEWISE on a mixed, queued workload; the capture counters are
exact (one segment more than splitting-op calls per size, the FULL graphs on top, no Dynamo graph
seen); nothing is captured while serving. On CPU this runs on the simgraph example platform,
whose segment replay re-executes the recorded ops on the captured buffers, so a runner that
forgot to copy an input would fail.
Run: pytest tests/engine/test_breakable_engine.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.core.counters import compilation_counter
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint
from pieceworks.sampling_params import SamplingParams

pytestmark = pytest.mark.platform_agnostic

MAX_NUM_SEQS = 4  # capture sizes 1, 2, 4, 8; FULL decode graphs for the three sizes <= 4
NUM_SIZES, NUM_DECODE_SIZES = 4, 3
# Untied, wider-initialised embeddings: greedy tokens that change from step to step (llama-tiny's
# tied embeddings mostly repeat the last token, which would hide a stale replay).
LLAMA_CONFIG = {**get_preset("llama-tiny"), "tie_word_embeddings": False, "initializer_range": 0.2}
BAMBA_CONFIG = {**get_preset("bamba-tiny"), "num_hidden_layers": 3, "attn_layer_indices": [1]}
NUM_SPLIT_CALLS = {"llama": 2, "bamba": 3}  # one splitting op per layer: attention or mixer
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["llama", "bamba"])
def checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp(request.param)
    hf_config = LLAMA_CONFIG if request.param == "llama" else BAMBA_CONFIG
    random_hf_checkpoint(hf_config, path, seed=3, dtype=torch.float32)
    return request.param, str(path)


def make_llm(path: str, mode: str) -> LLM:
    compilation = compilation_for_mode(mode, {"backend": "eager"})
    # A fixed KV cache: sized from free memory, a busy machine would schedule (and pad) the same
    # workload differently from one mode to the next.
    return LLM(
        path,
        compilation_config=compilation,
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        num_gpu_blocks_override=64,
    )


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(batch, GREEDY)]


@pytest.fixture(scope="module")
def eager_tokens(checkpoint) -> list[list[int]]:
    tokens = generate(make_llm(checkpoint[1], "eager"), WORKLOAD)
    assert all(len(set(row)) > 1 for row in tokens)  # a stale replay would show
    return tokens


WORKLOAD = prompts([3, 9, 17, 5, 2])  # five prompts, four slots: prefills, mixed, decodes


def test_breakable_piecewise_counts_and_tokens(checkpoint, graph_platform, eager_tokens):
    name, path = checkpoint
    # Every size is one capture of the forward: L splitting-op calls end L segments, plus the
    # last: (L + 1) segments per size, each a graph, as a level-3 PIECEWISE capture has L + 1
    # pieces. No Dynamo graph: level 0 compiles nothing.
    segments = NUM_SIZES * (NUM_SPLIT_CALLS[name] + 1)
    with compilation_counter.expect(
        num_graphs_seen=0,
        num_backend_compilations=0,
        num_gpu_runner_capture_triggers=1,
        num_cudagraph_captured=segments,
        num_breakable_segments_captured=segments,
    ):
        llm = make_llm(path, "breakable_piecewise")
    with compilation_counter.expect(num_cudagraph_captured=0, num_breakable_segments_captured=0):
        assert generate(llm, WORKLOAD) == eager_tokens
    assert llm.engine.runner.release_graphs() == segments  # one graph per segment, as counted


def test_breakable_counts_and_tokens(checkpoint, graph_platform, eager_tokens):
    name, path = checkpoint
    # FULL graphs of the whole eager forward for the three uniform-decode sizes <= 4, each with
    # its decode tail and masked tail, breakable graphs for all four mixed sizes:
    # 3 * 3 + 4 * (L + 1) graphs, 4 * (L + 1) of them segments.
    segments = NUM_SIZES * (NUM_SPLIT_CALLS[name] + 1)
    with compilation_counter.expect(
        num_graphs_seen=0,
        num_gpu_runner_capture_triggers=1,
        num_cudagraph_captured=3 * NUM_DECODE_SIZES + segments,
        num_decode_tails_captured=2 * NUM_DECODE_SIZES,
        num_breakable_segments_captured=segments,
    ):
        llm = make_llm(path, "breakable")
    with compilation_counter.expect(num_cudagraph_captured=0):
        assert generate(llm, WORKLOAD) == eager_tokens


def test_breakable_equals_level_3(checkpoint, graph_platform, eager_tokens):
    level_3 = generate(make_llm(checkpoint[1], "full_and_piecewise"), WORKLOAD)
    assert level_3 == eager_tokens  # and so equal to both breakable modes above
