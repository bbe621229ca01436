"""Speculative decoding with a draft model changes no greedy token a caller sees.

The workload of ``tests/engine/test_spec_decode_engine.py`` (arrivals, a small KV cache, a stop
token and a stop string, an abort, ``max_tokens`` of 1) runs with ``speculative_config`` method
``draft_model``: the target itself as the draft (every proposal right, in eager mode and with
FULL_AND_PIECEWISE graphs on simgraph for both models) and llama-tiny at its preset scale as the
draft (nearly every proposal wrong). Proved: the tokens, text and finish reasons of decoding
without speculation; proposals accepted (the self-draft: all of them); the draft's mirrors and
KV blocks are all freed once the target's requests are done; a draft of another vocabulary and a
draft_model config without a model are refused naming them.

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/engine/test_draft_model_engine.py -q``
"""

from __future__ import annotations

import pytest

from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.engine.llm import LLM
from tests.engine.test_host_path import NUM_BLOCKS, compilation_for_mode, results

__all__ = ["plain_run"]  # a fixture, imported for its module-scoped run
from tests.engine.test_spec_decode_engine import (
    ABORTED,
    K,
    check_streams,
    plain_run,
    run,
    save_scaled_llama_tiny,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_scaled_llama_tiny(tmp_path_factory.mktemp("llama-tiny"))


def make_llm(checkpoint: str, mode: str, draft: str | None) -> LLM:
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
    return LLM(
        checkpoint,
        compilation_config=compilation_for_mode(mode, {"backend": "eager"}),
        dtype="float32",
        max_num_seqs=4,
        num_gpu_blocks_override=NUM_BLOCKS,
        async_scheduling=False,
        speculative_config=spec if draft else None,
    )


@pytest.mark.platform_agnostic
@pytest.mark.parametrize(
    ("mode", "draft"),
    [("eager", "self"), ("full_and_piecewise", "self"), ("eager", "llama-tiny")],
)
def test_draft_model_tokens_equal_decoding_without_speculation(
    checkpoint, plain_run, graph_platform, mode, draft
):
    arrivals, plain = plain_run

    llm = make_llm(checkpoint, mode, checkpoint if draft == "self" else draft)
    steps = run(llm, arrivals)
    stats, proposer = llm.engine.scheduler.spec_decoding_stats, llm.engine.proposer
    check_streams(steps)
    spec = results(steps)
    assert {r: v for r, v in spec.items() if r != ABORTED} == {
        r: v for r, v in plain.items() if r != ABORTED
    }
    assert spec["b"][2] == "stop" and spec["c"][2] == "stop"
    if draft == "self":
        assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.9
    else:
        assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.5
    assert not proposer.mirrors and not proposer.scheduler.has_unfinished_requests()
    draft_blocks = proposer.scheduler.block_manager
    assert draft_blocks.num_free_blocks == draft_blocks.num_blocks
    llm.shutdown()


def test_a_draft_of_another_vocabulary_or_none_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs 'model'"):
        build_engine_config(
            "llama-tiny", speculative_config={"method": "draft_model", "num_speculative_tokens": 2}
        )
    config = build_engine_config(
        "llama-tiny",
        speculative_config={
            "method": "draft_model",
            "model": "llama-125m",
            "num_speculative_tokens": 2,
        },  # fmt: skip
    )
    from pieceworks.engine.arg_utils import draft_engine_config

    with pytest.raises(ValueError, match="must share the target's vocabulary"):
        draft_engine_config(config)
