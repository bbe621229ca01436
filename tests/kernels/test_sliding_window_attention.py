"""Sliding-window paged attention: the reference masks as transformers does, Triton matches it.

Proves that (1) `paged_attention_reference` with a window W equals a dense float64 attention where
a query at position p sees keys p - W + 1 .. p; (2) `paged_attention_triton` equals the reference
with windows smaller than, equal to and larger than the context, for decode (one and several
splits, the fused K/V store), prefill and mixed batches, with GQA; (3) neither reads a block-table
entry wholly before a window (those blocks may be freed): such entries point at a NaN block
here; (4) the decode split count looks at no more than the window.

The Triton kernels run interpreted on CPU tensors where no GPU is visible (the helpers come from
`test_attention_kernels.py`, which sets TRITON_INTERPRET=1 first); shapes stay small.

Run: TRITON_INTERPRET=1 PYTHONPATH=. python -m pytest \
    tests/kernels/test_sliding_window_attention.py -q
"""

import zlib

import pytest
import torch

from pieceworks.models.attention.ops import (
    choose_num_kv_splits,
    paged_attention_reference,
    plan_paged_attention,
    store_kv_cache_torch,
)
from tests.kernels.test_attention_kernels import (
    DEVICE,
    HEAD_SIZE,
    SENTINEL,
    TOLERANCES,
    PagedBatch,
    make_batch,
    requires_triton,
    run_triton,
)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def run_reference(batch: PagedBatch, window: int | None) -> torch.Tensor:
    output = torch.full_like(batch.query, SENTINEL)
    paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, output,
                              **batch.metadata(), sliding_window=window)  # fmt: skip
    return output


def poison_blocks_before_windows(batch: PagedBatch, query_lens: list[int], window: int) -> None:
    """Point every block-table entry that no query of its sequence can see at a block nobody
    owns, filled with NaN: a kernel that loaded it would write NaN (0 * NaN in p @ V)."""
    block_size = batch.key_cache.shape[1]
    owned = set(batch.block_tables.flatten().tolist())
    poison = next(b for b in range(batch.key_cache.shape[0]) if b not in owned)
    batch.key_cache[poison] = batch.value_cache[poison] = float("nan")
    seq_lens = batch.seq_lens.tolist()
    for seq, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        first_visible = max(seq_len - query_len - window + 1, 0)  # the first query's window
        batch.block_tables[seq, : first_visible // block_size] = poison


def assert_matches(batch: PagedBatch, output: torch.Tensor, window: int | None) -> None:
    real = batch.num_real_tokens
    expected = run_reference(batch, window)
    torch.testing.assert_close(output[:real], expected[:real], **TOLERANCES[output.dtype])
    assert (output[real:] == SENTINEL).all(), "a padded query row was written"


def test_reference_window_matches_dense_attention():
    window = 5
    batch = make_batch([23, 12], [9, 1], num_heads=4, num_kv_heads=2, block_size=4)
    output = run_reference(batch, window)
    starts = batch.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        rows = slice(starts[seq], starts[seq + 1])
        query, key, value = batch.query[rows].double(), batch.keys[seq], batch.values[seq]
        key, value = key.double().repeat_interleave(2, 1), value.double().repeat_interleave(2, 1)
        scores = torch.einsum("ihd,jhd->hij", query, key) * HEAD_SIZE**-0.5
        query_pos = torch.arange(seq_len - query.shape[0], seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        allowed = (key_pos <= query_pos) & (key_pos > query_pos - window)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        expected = torch.einsum("hij,jhd->ihd", weights, value)
        torch.testing.assert_close(output[rows].double(), expected, atol=1e-5, rtol=1e-5)


# Windows below, at and above the 70-token context of the longest sequence; 1 sees itself only.
WINDOWS = [1, 20, 70, 500]


@requires_triton
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_triton_decode_window(window, num_kv_splits):
    seq_lens = [1, 15, 33, 70]
    batch = make_batch(seq_lens, [1] * 4, num_heads=8, num_kv_heads=2)
    poison_blocks_before_windows(batch, [1] * 4, window)
    output = run_triton(batch, 1, num_kv_splits=num_kv_splits, sliding_window=window)
    assert_matches(batch, output, window)


@requires_triton
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_prefill_and_mixed_window(window):
    # A decode row, a chunked prefill with context, a whole prefill; padded rows after them.
    query_lens = [1, 21, 19]
    batch = make_batch([50, 70, 19], query_lens, num_heads=8, num_kv_heads=2, num_padded_tokens=2)
    poison_blocks_before_windows(batch, query_lens, window)
    assert_matches(batch, run_triton(batch, max(query_lens), sliding_window=window), window)


@requires_triton
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_triton_prefill_window_float16(num_heads, num_kv_heads):
    batch = make_batch([40, 7], [40, 7], num_heads=num_heads, num_kv_heads=num_kv_heads,
                       dtype=torch.float16, block_size=32)  # fmt: skip
    assert_matches(batch, run_triton(batch, 40, sliding_window=9), 9)


@requires_triton
def test_triton_decode_window_with_fused_kv_store():
    # The split holding the new token (from registers) is the window's last; the rest as before.
    seq_lens, window, block_size = [15, 70], 20, 16
    batch = make_batch(seq_lens, [1, 1], num_heads=8, num_kv_heads=2, block_size=block_size)
    poison_blocks_before_windows(batch, [1, 1], window)
    key = torch.randn(2, 2, HEAD_SIZE, device=DEVICE)
    value = torch.randn(2, 2, HEAD_SIZE, device=DEVICE)
    slots = [int(batch.block_tables[seq, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for seq, n in enumerate(seq_lens)]  # fmt: skip
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    expected_keys, expected_values = batch.key_cache.clone(), batch.value_cache.clone()
    store_kv_cache_torch(key, value, expected_keys, expected_values, slot_mapping)
    expected = torch.full_like(batch.query, SENTINEL)
    paged_attention_reference(batch.query, expected_keys, expected_values, expected,
                              **batch.metadata(), sliding_window=window)  # fmt: skip

    output = torch.full_like(batch.query, SENTINEL)
    launch = plan_paged_attention(batch.query, batch.key_cache, batch.value_cache, output,
                                  block_tables=batch.block_tables, scale=HEAD_SIZE**-0.5,
                                  max_query_len=1, num_kv_splits=2, new_kv=(key, value),
                                  sliding_window=window)  # fmt: skip
    launch(batch.query, batch.key_cache, batch.value_cache, output, batch.query_start_loc,
           batch.seq_lens, batch.block_tables, new_kv=(key, value, slot_mapping))  # fmt: skip
    torch.testing.assert_close(output, expected, **TOLERANCES[torch.float32])
    # (the NaN block included: equal_nan)
    torch.testing.assert_close(batch.key_cache, expected_keys, atol=0, rtol=0, equal_nan=True)


def test_decode_split_count_looks_at_the_window_only():
    # One sequence, 8 kv heads: full attention over 4096 slots wants 64 splits; a 128-token
    # window holds only 2 tiles of 64, so 2 splits.
    batch = make_batch([30], [1], num_heads=8, num_kv_heads=8)
    block_tables = torch.zeros((1, 256), dtype=torch.int32, device=DEVICE)
    for window, expected in ((None, choose_num_kv_splits(1, 8, 256 * 16)), (128, 2)):
        launch = plan_paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                      batch.query.clone(), block_tables=block_tables,
                                      scale=1.0, max_query_len=1,
                                      sliding_window=window)  # fmt: skip
        assert launch.split.grid[2] == expected
        assert launch.split.options["HAS_WINDOW"] is (window is not None)


def test_window_below_one_is_refused():
    batch = make_batch([5], [1])
    with pytest.raises(ValueError, match="sliding_window 0 must be at least 1"):
        plan_paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.query.clone(),
                             block_tables=batch.block_tables, scale=1.0, max_query_len=1,
                             sliding_window=0)  # fmt: skip
