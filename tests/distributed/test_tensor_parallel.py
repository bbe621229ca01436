"""Tensor parallelism on CPU: two gloo ranks, each with its own engine, match one process.

Proves, in float32, for llama-tiny (4 query heads, 2 KV heads: both split), a Llama with one KV
head (replicated on both ranks; attention and MLP biases, untied LM head), a Mistral with a
sliding window of 8 (shorter than a 20-token prompt, whose first KV block the scheduler frees
as it decodes; saved by transformers), bamba-tiny (one B/C
group, so the gated norm sums across ranks) and a Bamba with two groups (split): at compilation
level 0 and level 3 (eager backend) every rank's logits of every step equal the single-process
engine's within 1e-4 of the logit scale (the all-reduce sums in another order) and the greedy
tokens are identical; KV caches and Mamba states hold the rank's heads only; level 3 splits the
model into exactly the pieces it has at tp 1 (the all-reduce is traced into the pieces, not a
split point). Under the default ``SamplingParams`` (temperature 1, unseeded), with each rank's
default generator seeded differently, both ranks hold the same tokens token for token and the
same logits every step, and those are the tokens and logits of a single process seeded as rank 0.
FP8 Llama at tp 2 (per-rank weight scales) stays within FP8's error of the unquantized model. A
configuration that cannot be sharded and a rank that fails on its own both surface as the rank's
error in the test, not as a hang. One spawn per model family runs all of its configurations.
Run: pytest tests/distributed/test_tensor_parallel.py
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint
from tests.distributed.rank_workers import (
    MAX_NUM_SEQS,
    NUM_BLOCKS,
    SAMPLING_SEED,
    build_engine,
    engine_config,
    fail_on_rank,
    generate,
    generate_runs,
    sample_on_ranks,
)
from tests.distributed.spawn import RankFailed, run_ranks

TP_SIZE = 2
LOGIT_TOLERANCE = 1e-4  # of max |logit|: float32, summed in a different order
MAX_FP8_RELATIVE_RMS_ERROR = 0.08  # as tests/models/test_fp8.py (e4m3: about 4 % measured)
MAX_TOKENS = 5
PROMPTS = [[5, 9, 17, 3], list(range(10, 30)), [100, 7], [42] * 9, [200, 3, 77]]  # 5 > 4 seqs

LLAMA_CONFIGS = {
    "llama-gqa": get_preset("llama-tiny"),
    "llama-kv1": {
        **get_preset("llama-tiny"),
        "num_key_value_heads": 1,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": False,
    },
}
BAMBA_CONFIGS = {
    "bamba-1group": get_preset("bamba-tiny"),
    "bamba-2groups": {**get_preset("bamba-tiny"), "mamba_n_groups": 2},
}
# Saved by transformers (``tests/models/test_mistral_hf.py``); run in the Llama family's spawn.
MISTRAL_CONFIGS = {"mistral-window": {"sliding_window": 8, "tie_word_embeddings": False}}
MODES = ("eager", "compiled")  # level 0; level 3 without graphs (CPU has none)
# Pieces at level 3: one per attention or Mamba layer plus the runs around them, 2L + 1.
NUM_PIECES = {"llama": 2 * 2 + 1, "bamba": 2 * 4 + 1}


def save_checkpoints(tmp_path_factory, configs: dict) -> dict[str, str]:
    paths = {}
    for seed, (name, hf_config) in enumerate(configs.items()):
        path = tmp_path_factory.mktemp(name)
        random_hf_checkpoint(hf_config, path, seed=seed + 3, dtype=torch.float32)
        paths[name] = str(path)
    return paths


def runs_of(checkpoints: dict[str, str]) -> dict[str, tuple[str, str, dict]]:
    return {
        f"{name}/{mode}": (path, mode, {}) for name, path in checkpoints.items() for mode in MODES
    }


@pytest.fixture(scope="module")
def llama_checkpoints(tmp_path_factory) -> dict[str, str]:
    from tests.models.test_mistral_hf import save_hf_checkpoint

    paths = save_checkpoints(tmp_path_factory, LLAMA_CONFIGS)
    for name, fields in MISTRAL_CONFIGS.items():
        paths[name] = str(tmp_path_factory.mktemp(name))
        save_hf_checkpoint(paths[name], fields)
    return paths


@pytest.fixture(scope="module")
def bamba_checkpoints(tmp_path_factory) -> dict[str, str]:
    return save_checkpoints(tmp_path_factory, BAMBA_CONFIGS)


@pytest.fixture(scope="module")
def llama_tp(llama_checkpoints, tmp_path_factory) -> list[dict]:
    runs = runs_of(llama_checkpoints)
    runs["llama-gqa/fp8"] = (llama_checkpoints["llama-gqa"], "eager", {"quantization": "fp8"})
    init_file = tmp_path_factory.mktemp("llama-tp") / "init"
    return run_ranks(generate_runs, (runs, PROMPTS, MAX_TOKENS), init_file, world_size=TP_SIZE)


@pytest.fixture(scope="module")
def bamba_tp(bamba_checkpoints, tmp_path_factory) -> list[dict]:
    runs = runs_of(bamba_checkpoints)
    init_file = tmp_path_factory.mktemp("bamba-tp") / "init"
    return run_ranks(generate_runs, (runs, PROMPTS, MAX_TOKENS), init_file, world_size=TP_SIZE)


@pytest.fixture(scope="module")
def references(llama_checkpoints, bamba_checkpoints) -> dict[str, tuple]:
    """Tokens and step logits of the single-process (tp 1) engine, eager."""
    checkpoints = {**llama_checkpoints, **bamba_checkpoints}
    return {
        name: generate(engine_config(path, "eager"), PROMPTS, MAX_TOKENS)
        for name, path in checkpoints.items()
    }


def assert_matches_reference(output: dict, reference: tuple, what: str) -> None:
    ref_tokens, ref_logits = reference
    assert output["tokens"] == ref_tokens, what
    assert len(output["logits"]) == len(ref_logits), what
    for step, (logits, expected) in enumerate(zip(output["logits"], ref_logits)):
        assert logits.shape == expected.shape, f"{what} step {step}"
        error = np.abs(logits - expected).max() / np.abs(expected).max()
        assert error <= LOGIT_TOLERANCE, f"{what} step {step}: relative max error {error:.2e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [*LLAMA_CONFIGS, *MISTRAL_CONFIGS])
def test_llama_tp2_equals_tp1(llama_tp, references, name, mode):
    for rank, outputs in enumerate(llama_tp):  # every rank holds the full logits
        assert_matches_reference(outputs[f"{name}/{mode}"], references[name], f"rank {rank}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(BAMBA_CONFIGS))
def test_bamba_tp2_equals_tp1(bamba_tp, references, name, mode):
    for rank, outputs in enumerate(bamba_tp):
        assert_matches_reference(outputs[f"{name}/{mode}"], references[name], f"rank {rank}")


def test_all_reduce_is_traced_into_pieces_not_split(llama_tp, bamba_tp):
    for family, outputs in (("llama", llama_tp), ("bamba", bamba_tp)):
        for rank_outputs in outputs:
            for label, output in rank_outputs.items():
                expected = NUM_PIECES[family] if label.endswith("/compiled") else 0
                assert output["pieces"] == expected, label


def test_caches_are_sized_per_rank(llama_tp, bamba_tp):
    kv_shape = (NUM_BLOCKS, 16, 1, 16)  # (blocks, block_size, KV heads of a rank, head_dim)
    for outputs in llama_tp:  # llama-gqa: 2 KV heads split; llama-kv1: 1 replicated
        assert outputs["llama-gqa/eager"]["caches"]["kv"] == [kv_shape] * 2
        assert outputs["llama-kv1/eager"]["caches"]["kv"] == [kv_shape] * 2
    for outputs in bamba_tp:  # 3 Mamba layers and one attention layer (2 KV heads)
        caches = outputs["bamba-1group/eager"]["caches"]
        num_slots = MAX_NUM_SEQS + 1
        assert caches["kv"] == [kv_shape]
        # conv: this rank's x (128 / 2) plus one group's B and C (16 each); SSM: 8 / 2 heads.
        assert caches["conv"] == [(num_slots, 64 + 2 * 16, 3)] * 3
        assert caches["ssm"] == [(num_slots, 4, 16, 16)] * 3


def test_fp8_tp2_within_fp8_error_of_unquantized(llama_tp, references):
    expected = torch.from_numpy(references["llama-gqa"][1][0])  # prefill logits, unquantized
    for outputs in llama_tp:
        fp8 = torch.from_numpy(outputs["llama-gqa/fp8"]["logits"][0])
        error = float((fp8 - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())
        assert 1e-3 < error < MAX_FP8_RELATIVE_RMS_ERROR  # really quantized, and not broken
    first, second = (outputs["llama-gqa/fp8"]["logits"] for outputs in llama_tp)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))  # ranks agree exactly


def test_unseeded_sampling_agrees_across_ranks_token_for_token(llama_checkpoints, tmp_path):
    checkpoint = llama_checkpoints["llama-gqa"]
    args = (checkpoint, PROMPTS, MAX_TOKENS)
    first, second = run_ranks(sample_on_ranks, args, tmp_path / "init", world_size=TP_SIZE)
    # Rank 1 draws other numbers than rank 0: without rank 0's ids broadcast, its tokens differ,
    # it feeds them to its next step, and the all-reduced hidden states mix two sequences.
    assert second["tokens"] == first["tokens"]
    assert len(second["logits"]) == len(first["logits"])
    assert all(np.array_equal(a, b) for a, b in zip(first["logits"], second["logits"]))
    reference = generate(
        engine_config(checkpoint, "eager"), PROMPTS, MAX_TOKENS, default_seed=SAMPLING_SEED
    )
    assert_matches_reference(first, reference, "rank 0 against one process seeded alike")
    assert len({token for row in first["tokens"] for token in row}) > MAX_TOKENS  # it sampled


def test_unshardable_heads_surface_as_the_ranks_error(tmp_path):
    hf_config = {**get_preset("llama-tiny"), "num_attention_heads": 3, "num_key_value_heads": 1}
    random_hf_checkpoint(hf_config, tmp_path / "ckpt", seed=0, dtype=torch.float32)
    message = "num_attention_heads=3 is not divisible by tensor_parallel_size=2"
    with pytest.raises(RankFailed, match=message):
        run_ranks(build_engine, (str(tmp_path / "ckpt"),), tmp_path / "init", world_size=TP_SIZE)


def test_one_failing_rank_does_not_hang_the_others(llama_checkpoints, tmp_path):
    # Rank 0 builds its engine and blocks in the first all-reduce, waiting for rank 1 forever.
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 set-up failed on purpose"):
        args = (llama_checkpoints["llama-gqa"], 1)
        run_ranks(fail_on_rank, args, tmp_path / "init", world_size=TP_SIZE, timeout=60)
    assert time.monotonic() - start < 60  # surfaced by rank 1's error, not by the timeout
