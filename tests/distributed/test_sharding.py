"""The sharding rules, in one process: each rank's layer is built under a stand-in TP group.

Proves: heads (and Mamba groups) split when there are at least as many as ranks and replicate
otherwise, rank ``r`` holding ``r * total // tp`` (vLLM's KV rule), with a ValueError naming the
config field when neither works; QKV, gate/up, row-parallel and vocabulary layers built per rank
and fed the whole checkpoint tensor compute, summed or concatenated over ranks, what the unsharded
layer computes (the bias of a row-parallel layer counted once); vocabulary shards are
``cdiv(vocab, tp)`` rows, the padding zero, ids held elsewhere embedded as zeros; Mamba's
``in_proj`` and ``conv1d`` rows per rank; a mis-shaped checkpoint tensor still names itself; a
model built for tensor parallelism without an initialised group is a clear error. The real
collectives (gloo, two processes) are checked once too.
Run: pytest tests/distributed/test_sharding.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pieceworks.config import EngineConfig, ModelConfig, ParallelConfig
from pieceworks.distributed import parallel_state
from pieceworks.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    shard_or_replicate,
)
from pieceworks.models.layers.vocab_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    vocab_range,
)
from pieceworks.models.loading.loader import initialize_model
from pieceworks.models.loading.presets import get_preset
from pieceworks.models.loading.weight_utils import WeightLoadingError
from pieceworks.models.mamba.sharding import Mamba2Sharding
from tests.distributed.rank_workers import group_collectives
from tests.distributed.spawn import run_ranks

HIDDEN, HEAD_DIM = 64, 16


class StandInGroup:
    """A TP group of one process that believes it is ``rank`` of ``world_size``.

    Its all-reduce returns the rank's own partial result, so a test adds the ranks up itself.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank_in_group, self.world_size = rank, world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.fixture
def as_rank(monkeypatch):
    """``as_rank(r, tp)``: layers built afterwards shard as rank ``r`` of ``tp``."""

    def set_rank(rank: int, world_size: int) -> None:
        monkeypatch.setattr(parallel_state, "_TP", StandInGroup(rank, world_size))

    return set_rank


@pytest.mark.parametrize(
    ("total", "tp_size", "expected"),
    [
        (8, 2, [(0, 4), (4, 4)]),  # split
        (2, 2, [(0, 1), (1, 1)]),
        (1, 2, [(0, 1), (0, 1)]),  # one head, both ranks
        (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # head r * 2 // 4
    ],
)
def test_shard_or_replicate(total, tp_size, expected):
    assert [
        shard_or_replicate(total, rank, tp_size, "heads") for rank in range(tp_size)
    ] == expected


@pytest.mark.parametrize(("total", "tp_size"), [(3, 2), (2, 3), (6, 4)])
def test_unshardable_counts_say_what_to_change(total, tp_size):
    with pytest.raises(ValueError, match=f"num_key_value_heads={total} .*tensor_parallel_size"):
        shard_or_replicate(total, 0, tp_size, "num_key_value_heads")


def qkv_checkpoint(num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    sizes = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
    return {
        name: torch.randn(heads * HEAD_DIM, HIDDEN, generator=generator)
        for name, heads in sizes.items()
    }


def qkv_for_rank(as_rank, rank, tp_size, checkpoint, num_heads, num_kv_heads, by_shard=True):
    as_rank(rank, tp_size)
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, num_heads, num_kv_heads, prefix="qkv_proj")
    if by_shard:
        for shard_id, tensor in checkpoint.items():
            layer.weight_loader(layer.weight, tensor, shard_id)
    else:
        layer.weight_loader(layer.weight, torch.cat(list(checkpoint.values())))
    return layer


def heads(tensor: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return tensor[first * HEAD_DIM : (first + count) * HEAD_DIM]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tp_size", "kv_head_of_rank"),
    [(4, 2, 2, [0, 1]), (4, 1, 2, [0, 0]), (4, 2, 4, [0, 0, 1, 1])],
)
def test_qkv_splits_query_heads_and_splits_or_replicates_kv(
    as_rank, num_heads, num_kv_heads, tp_size, kv_head_of_rank
):
    checkpoint = qkv_checkpoint(num_heads, num_kv_heads)
    q_per_rank = num_heads // tp_size
    for rank in range(tp_size):
        layer = qkv_for_rank(as_rank, rank, tp_size, checkpoint, num_heads, num_kv_heads)
        kv_per_rank = layer.num_kv_heads
        assert (layer.num_heads, kv_per_rank) == (q_per_rank, max(1, num_kv_heads // tp_size))
        assert layer.num_kv_head_replicas == max(1, tp_size // num_kv_heads)
        q, k, v = layer.weight.split([q_per_rank * HEAD_DIM, *[kv_per_rank * HEAD_DIM] * 2])
        assert torch.equal(q, heads(checkpoint["q"], rank * q_per_rank, q_per_rank))
        assert torch.equal(k, heads(checkpoint["k"], kv_head_of_rank[rank], kv_per_rank))
        assert torch.equal(v, heads(checkpoint["v"], kv_head_of_rank[rank], kv_per_rank))
        whole = qkv_for_rank(
            as_rank, rank, tp_size, checkpoint, num_heads, num_kv_heads, by_shard=False
        )
        assert torch.equal(whole.weight, layer.weight)  # a pre-merged qkv tensor shards alike


def test_qkv_mis_shaped_tensor_names_itself(as_rank):
    as_rank(1, 2)
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, 4, 2, prefix="model.layers.0.self_attn.qkv_proj")
    with pytest.raises(WeightLoadingError, match=r"qkv_proj.weight shard 'k': expected shape"):
        layer.weight_loader(layer.weight, torch.zeros(HEAD_DIM, HIDDEN), "k")  # one head, not 2


def test_merged_column_shards_each_piece(as_rank):
    gate, up = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    for rank in range(2):
        as_rank(rank, 2)
        layer = MergedColumnParallelLinear(HIDDEN, [8, 8], prefix="gate_up_proj")
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        rows = slice(rank * 4, rank * 4 + 4)
        assert torch.equal(layer.weight, torch.cat([gate[rows], up[rows]]))


def test_row_parallel_partial_sums_add_up_with_the_bias_once(as_rank):
    weight, bias, x = torch.randn(HIDDEN, 32), torch.randn(HIDDEN), torch.randn(5, 32)
    partial_sums = []
    for rank in range(2):
        as_rank(rank, 2)
        layer = RowParallelLinear(32, HIDDEN, bias=True, prefix="o_proj")
        layer.weight_loader(layer.weight, weight)
        layer.weight_loader(layer.bias, bias)
        partial_sums.append(layer(x[:, rank * 16 : rank * 16 + 16]))  # this rank's input slice
    torch.testing.assert_close(sum(partial_sums), F.linear(x, weight, bias))


@pytest.mark.parametrize(
    ("vocab_size", "tp_size", "expected"),
    [
        (10, 4, [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]),  # last shard: 1 id + 2 padding
        (5, 4, [(0, 2, 2), (2, 4, 2), (4, 5, 2), (5, 5, 2)]),  # last rank: padding only
        (8, 2, [(0, 4, 4), (4, 8, 4)]),
    ],
)
def test_vocab_range(vocab_size, tp_size, expected):
    assert [vocab_range(vocab_size, rank, tp_size) for rank in range(tp_size)] == expected


def test_vocab_shards_pad_with_zeros_and_mask_ids_held_elsewhere(as_rank):
    vocab_size, tp_size = 10, 4
    table, hidden = torch.randn(vocab_size, HIDDEN), torch.randn(3, HIDDEN)
    input_ids = torch.tensor([0, 4, 9, 5, 9])
    embeddings, logits = [], []
    for rank in range(tp_size):
        as_rank(rank, tp_size)
        embedding = VocabParallelEmbedding(vocab_size, HIDDEN, prefix="embed_tokens")
        embedding.weight_loader(embedding.weight, table)
        lm_head = ParallelLMHead(vocab_size, HIDDEN).tie_weights(embedding)
        start, end, _ = vocab_range(vocab_size, rank, tp_size)
        assert torch.equal(embedding.weight[: end - start], table[start:end])
        assert not embedding.weight[end - start :].any()  # padding rows are zeros
        output = embedding(input_ids)
        held = (input_ids >= start) & (input_ids < end)
        assert not output[~held].any()  # ids of other ranks contribute nothing
        embeddings.append(output)
        logits.append(lm_head(hidden))
    torch.testing.assert_close(sum(embeddings), F.embedding(input_ids, table))  # the all-reduce
    gathered = torch.cat(logits, dim=-1)  # (3, 4 * 3): the all-gather
    assert not gathered[:, vocab_size:].any()
    torch.testing.assert_close(gathered[:, :vocab_size], hidden @ table.t())


def test_mamba_in_proj_and_conv_rows():
    # bamba-tiny: H=8 heads of P=16 (I=128), N=16; in_proj = [z 128, x 128, B 16, C 16, dt 8].
    one_group = [Mamba2Sharding(8, 16, 1, 16, rank, 2) for rank in range(2)]
    assert [s.in_proj_rows() for s in one_group] == [
        [(0, 64), (128, 64), (256, 16), (272, 16), (288, 4)],
        [(64, 64), (192, 64), (256, 16), (272, 16), (292, 4)],  # B, C replicated
    ]
    assert [s.conv_rows() for s in one_group] == [
        [(0, 64), (128, 16), (144, 16)],
        [(64, 64), (128, 16), (144, 16)],
    ]
    assert one_group[1].local_conv_dim == 64 + 2 * 16 and one_group[1].norm_group_spans_ranks
    # Two groups (B = [B0, B1] at 256, C = [C0, C1] at 288, dt at 320): one per rank at tp 2;
    # at tp 4 each is held by 2 ranks (rank r: group r // 2, its heads 2r and 2r + 1).
    two_groups = [Mamba2Sharding(8, 16, 2, 16, rank, 2) for rank in range(2)]
    assert [s.in_proj_rows()[2:4] for s in two_groups] == [
        [(256, 16), (288, 16)],
        [(272, 16), (304, 16)],
    ]
    assert not two_groups[0].norm_group_spans_ranks
    four_ranks = [Mamba2Sharding(8, 16, 2, 16, rank, 4) for rank in range(4)]
    assert [s.group_start for s in four_ranks] == [0, 0, 1, 1]
    assert [s.in_proj_rows()[4] for s in four_ranks] == [(320, 2), (322, 2), (324, 2), (326, 2)]


@pytest.mark.parametrize(
    ("num_heads", "num_groups", "tp_size", "message"),
    [
        (6, 1, 4, "mamba_n_heads=6 is not divisible by tensor_parallel_size=4"),
        (6, 3, 2, "mamba_n_groups=3 is not divisible by tensor_parallel_size=2"),
    ],
)
def test_mamba_unshardable_config_says_what_to_change(num_heads, num_groups, tp_size, message):
    with pytest.raises(ValueError, match=message):
        Mamba2Sharding(num_heads, 16, num_groups, 16, 0, tp_size)


def test_model_for_tp_without_an_initialised_group_is_a_clear_error():
    model_config = ModelConfig(model="llama-tiny", hf_config=get_preset("llama-tiny"))
    config = EngineConfig(
        model_config=model_config, parallel_config=ParallelConfig(tensor_parallel_size=2, rank=1)
    )
    with pytest.raises(RuntimeError, match=r"init_distributed_environment\(2, 1\)"):
        initialize_model(config, "cpu")


def test_uninitialised_state_is_one_rank():
    assert parallel_state.tensor_parallel_rank_and_size() == (0, 1)
    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed_environment"):
        parallel_state.get_tp_group()
    parallel_state.destroy_distributed_environment()  # safe when nothing was initialised


def test_group_collectives_on_two_gloo_ranks(tmp_path):
    outputs = run_ranks(group_collectives, (), tmp_path / "init", world_size=2)
    for rank, output in enumerate(outputs):
        assert output["rank_and_size"] == (rank, 2)
        assert output["input_untouched"]  # the op is out of place
        assert output["all_reduce"] == output["op"] == [[3.0] * 3] * 2  # 1 + 2
        assert output["gather_last"] == [[0.0, 1.0]] * 2
        assert output["gather_first"] == [[0.0] * 3, [1.0] * 3]
        assert output["object"] == {"from": 0}
