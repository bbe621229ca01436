"""Tensor parallelism on CPU for Gemma 3: two gloo ranks, each with its own engine, match one
process.

Proves, in float32, for the transformers-saved Gemma 3 checkpoint of ``test_gemma3_hf.py``
(4 query heads and 2 KV heads, both split; sliding and full layers; the per-head q/k norms
replicated; final logit soft-capping on the gathered logits), eagerly, that every rank's logits of
every step equal the single-process engine's within 1e-4 of the logit scale and the greedy tokens
are identical, and the KV caches hold each rank's heads alike. Level 3 under tensor parallelism
is the same for every model (``test_tensor_parallel.py``); one spawn, one mode, keeps this cheap.
Run: pytest tests/distributed/test_tensor_parallel_gemma3.py
"""

from __future__ import annotations

import pytest

from tests.distributed.rank_workers import engine_config, generate, generate_runs
from tests.distributed.spawn import run_ranks
from tests.distributed.test_tensor_parallel import (
    MAX_TOKENS,
    PROMPTS,
    TP_SIZE,
    assert_matches_reference,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from tests.models.test_gemma3_hf import CONFIGS, save_hf_checkpoint

    path = tmp_path_factory.mktemp("gemma3-softcap")
    save_hf_checkpoint(path, CONFIGS["softcap"], seed=3)
    return str(path)


@pytest.fixture(scope="module")
def gemma3_tp(checkpoint, tmp_path_factory) -> list[dict]:
    runs = {"eager": (checkpoint, "eager", {})}
    init_file = tmp_path_factory.mktemp("gemma3-tp") / "init"
    return run_ranks(generate_runs, (runs, PROMPTS, MAX_TOKENS), init_file, world_size=TP_SIZE)


def test_gemma3_tp2_equals_tp1(gemma3_tp, checkpoint):
    reference = generate(engine_config(checkpoint, "eager"), PROMPTS, MAX_TOKENS)
    for rank, outputs in enumerate(gemma3_tp):  # every rank holds the full logits
        assert_matches_reference(outputs["eager"], reference, f"rank {rank}")
    kv_heads_per_rank = [shape[2] for shape in gemma3_tp[0]["eager"]["caches"]["kv"]]
    assert kv_heads_per_rank == [1] * 3  # 2 KV heads over 2 ranks, in each of the 3 layers
