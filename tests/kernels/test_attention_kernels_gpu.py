"""Attention kernels on a real GPU: Triton matches the reference in bf16 at model shapes, and a
captured decode graph replays correctly with new metadata values in the same buffers.

Proves that `paged_attention_triton` equals `paged_attention_reference` with 32 q heads, 8 kv
heads, head size 128, block size 16, contexts up to 8192 and batches of 1 to 64, for decode,
prefill (with and without cached context) and mixed batches, also with sliding windows of 1, 100
and 4096 positions; and that `store_kv_cache_triton` plus a decode call captured once into a CUDA
graph give the right answer when replayed after the runner rewrites query, slot_mapping, seq_lens
and block_tables in place (padding included).

Run (GPU machine): PYTHONPATH=. python -m pytest tests/kernels/test_attention_kernels_gpu.py -q
"""

import pytest
import torch

from pieceworks.models.attention.ops import (
    paged_attention_reference,
    paged_attention_triton,
    store_kv_cache_triton,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

DEVICE = torch.device("cuda")
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
MAX_MODEL_LEN = 8192
SCALE = HEAD_SIZE**-0.5
DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_batch(seq_lens: list[int], query_lens: list[int]) -> dict:
    """Random paged K/V (shuffled blocks) for ragged sequences; tables sized to MAX_MODEL_LEN."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    num_blocks = sum(blocks_per_seq) + 1
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    block_ids = torch.randperm(num_blocks, device=DEVICE).int()
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=DEVICE)
    used = 0
    for seq_idx, num_seq_blocks in enumerate(blocks_per_seq):
        block_tables[seq_idx, :num_seq_blocks] = block_ids[used : used + num_seq_blocks]
        used += num_seq_blocks
    query_start_loc = torch.tensor([0, *query_lens], device=DEVICE).cumsum(0).int()
    return dict(
        query=torch.randn(sum(query_lens), NUM_HEADS, HEAD_SIZE, device=DEVICE, dtype=DTYPE),
        key_cache=torch.randn(cache_shape, device=DEVICE, dtype=DTYPE),
        value_cache=torch.randn(cache_shape, device=DEVICE, dtype=DTYPE),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables,
    )


def attend(batch: dict, fn, **kwargs) -> torch.Tensor:
    """Run one attention implementation into a NaN-poisoned output buffer."""
    output = torch.full_like(batch["query"], float("nan"))
    fn(batch["query"], batch["key_cache"], batch["value_cache"], output,
       query_start_loc=batch["query_start_loc"], seq_lens=batch["seq_lens"],
       block_tables=batch["block_tables"], scale=SCALE, **kwargs)  # fmt: skip
    return output


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 outputs: elementwise within bf16 rounding, and small error relative to the norm."""
    assert torch.isfinite(actual).all(), "NaN/inf (or an unwritten row) in the output"
    torch.testing.assert_close(actual, expected, atol=3e-3, rtol=2e-2)
    relative = (actual.float() - expected.float()).norm() / expected.float().norm()
    assert relative < 1e-2, f"relative error {relative:.2e}"


def check(seq_lens: list[int], query_lens: list[int], **kwargs) -> None:
    batch = make_batch(seq_lens, query_lens)
    expected = attend(batch, paged_attention_reference)
    actual = attend(batch, paged_attention_triton, max_query_len=max(query_lens), **kwargs)
    assert_close_bf16(actual, expected)


@pytest.mark.parametrize("context_len", [1, 15, 17, 1000, 4097, 8192])
def test_decode_batch_1(context_len):
    check([context_len], [1])


@pytest.mark.parametrize("batch_size", [8, 64])
def test_decode_ragged_batch(batch_size):
    seq_lens = torch.randint(1, MAX_MODEL_LEN + 1, (batch_size,)).tolist()
    seq_lens[0] = MAX_MODEL_LEN
    check(seq_lens, [1] * batch_size)


@pytest.mark.parametrize("num_kv_splits", [1, 7, 32])
def test_decode_explicit_splits(num_kv_splits):
    check([8192, 3000, 100, 1], [1] * 4, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [
        ([2048], [2048]),  # one long prompt
        ([1000, 17, 513, 64], [1000, 17, 513, 64]),  # ragged prompts
        ([8192, 4500], [512, 300]),  # chunked prefill after a long cached context
    ],
)
def test_prefill(seq_lens, query_lens):
    check(seq_lens, query_lens)


def test_mixed_batch():
    decode_lens = torch.randint(1, MAX_MODEL_LEN + 1, (32,)).tolist()
    seq_lens = decode_lens + [700, 8192, 45]
    query_lens = [1] * 32 + [700, 256, 45]
    check(seq_lens, query_lens)


@pytest.mark.parametrize("sliding_window", [1, 100, 4096])
@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [
        ([8192, 4097, 100, 1], [1, 1, 1, 1]),  # decode: windows below and above the context
        ([8192, 4500, 700, 3000], [512, 300, 700, 1]),  # chunked prefill, prefill, decode
    ],
)
def test_sliding_window(seq_lens, query_lens, sliding_window):
    batch = make_batch(seq_lens, query_lens)
    expected = attend(batch, paged_attention_reference, sliding_window=sliding_window)
    actual = attend(batch, paged_attention_triton, max_query_len=max(query_lens),
                    sliding_window=sliding_window)  # fmt: skip
    assert_close_bf16(actual, expected)


def test_decode_graph_replays_with_new_metadata():
    # Capture store + attention once for a padded batch of 8, as the runner does, then rewrite
    # every input in place (5 real sequences, 3 padded ones) and replay.
    num_seqs = 8
    batch = make_batch([MAX_MODEL_LEN] * num_seqs, [1] * num_seqs)
    key = torch.randn(num_seqs, NUM_KV_HEADS, HEAD_SIZE, device=DEVICE, dtype=DTYPE)
    value = torch.randn_like(key)
    slot_mapping = torch.zeros(num_seqs, dtype=torch.int64, device=DEVICE)
    output = torch.zeros_like(batch["query"])

    def step():
        store_kv_cache_triton(key, value, batch["key_cache"], batch["value_cache"], slot_mapping)
        paged_attention_triton(batch["query"], batch["key_cache"], batch["value_cache"], output,
                               query_start_loc=batch["query_start_loc"],
                               seq_lens=batch["seq_lens"], block_tables=batch["block_tables"],
                               scale=SCALE, max_query_len=1)  # fmt: skip

    graph = _capture(step)
    for seq_lens in ([5, 8192, 333, 17, 4096], [1, 2, 3, 4000, 8000]):
        _rewrite_decode_inputs(batch, key, value, slot_mapping, seq_lens, num_seqs)
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        num_real = len(seq_lens)
        stored = batch["key_cache"].flatten(0, 1)[slot_mapping[:num_real]]  # (num_real, Hkv, D)
        assert torch.equal(stored, key[:num_real]), "the captured store missed the new slots"
        expected = attend(batch, paged_attention_reference)
        assert_close_bf16(output[:num_real], expected[:num_real])
        assert output[num_real:].isnan().all(), "padded rows must be left untouched"


def _capture(step) -> torch.cuda.CUDAGraph:
    """Warm up (Triton compiles on first launch) on a side stream, then capture `step`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _rewrite_decode_inputs(batch, key, value, slot_mapping, seq_lens, num_seqs) -> None:
    """New values for every static input: real sequences first, then padded ones."""
    num_real = len(seq_lens)
    num_blocks = batch["key_cache"].shape[0]
    padded_lens = seq_lens + [0] * (num_seqs - num_real)
    batch["seq_lens"].copy_(torch.tensor(padded_lens, dtype=torch.int32))
    batch["query_start_loc"].copy_(torch.tensor([min(i, num_real) for i in range(num_seqs + 1)]))
    batch["block_tables"].copy_(torch.randperm(num_blocks)[: batch["block_tables"].numel()]
                                .view_as(batch["block_tables"]))  # fmt: skip
    batch["query"].copy_(torch.randn_like(batch["query"]))
    key.copy_(torch.randn_like(key))
    value.copy_(torch.randn_like(value))
    # The new token of sequence s lands at position seq_len - 1 of its (new) block table.
    tables = batch["block_tables"].long().cpu()
    slots = [int(tables[s, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
             for s, n in enumerate(seq_lens)]  # fmt: skip
    slot_mapping.copy_(torch.tensor(slots + [-1] * (num_seqs - num_real)))
