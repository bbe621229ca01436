"""Attention kernels at small shapes: the reference is right, the KV store and Triton match it.

Proves that (1) `paged_attention_reference` equals a dense float64 causal attention computed
without paging, for prefill, decode, mixed batches, GQA and shuffled block tables; (2) both
`store_kv_cache` implementations write exactly the given slots and never a slot of -1; (3)
`paged_attention_triton` (decode split-KV path and prefill/mixed path) equals the reference,
including ragged lengths, context lengths off the block grid or shorter than one split, padded
sequences, padded query rows, GQA ratios 1 and 4, block sizes 16 and 32, float32 and float16;
(4) a decode with one split writes its output without the reduce and without scratch; (5) with an
FP8 output (`output_scale`), the decode kernel that writes the output writes exactly
`static_scaled_fp8_quant` of what the unquantized kernels write (byte for byte, several splits,
GQA, a padded sequence, saturated values; padded rows untouched), the prefill/mixed path too, and
both stay within one e4m3 step of the quantized reference; a dtype that does not match the
request raises.

Where no GPU is visible the Triton kernels run in Triton's interpreter on CPU tensors: this module
sets TRITON_INTERPRET=1 (unless already set) before it imports the kernels, because triton decides
interpreted-or-compiled when a kernel is decorated. If another module imported the kernels first,
compiled, the Triton tests skip and say so. On a GPU machine (variable unset) the same tests run
compiled, on the GPU. Shapes stay small because the interpreter is slow.

Run: TRITON_INTERPRET=1 PYTHONPATH=. python -m pytest tests/kernels/test_attention_kernels.py -q
"""

import dataclasses
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels below are decorated

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE, KERNEL_FP8_MAX, static_scaled_fp8_quant  # noqa: E402
from pieceworks.kernels.attention import triton_attention  # noqa: E402
from pieceworks.models.attention.ops import (  # noqa: E402
    paged_attention_reference,
    paged_attention_triton,
    store_kv_cache_torch,
    store_kv_cache_triton,
)

INTERPRETED = isinstance(triton_attention._prefill_kernel, InterpretedFunction)
ON_GPU = not INTERPRETED and torch.cuda.is_available()
# Interpreted kernels read CPU tensors; compiled kernels need tensors on the GPU.
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
requires_triton = pytest.mark.skipif(
    not INTERPRETED and not ON_GPU,
    reason="the Triton kernels were imported compiled before TRITON_INTERPRET=1 was set and no "
    "GPU is visible: run with TRITON_INTERPRET=1 in the environment",
)
HEAD_SIZE = 32
SENTINEL = 999.0  # poison: no attention output (a convex mix of V rows) can equal it
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Each test draws its own inputs, reproducibly: the seed is a hash of the test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@dataclasses.dataclass
class PagedBatch:
    """A ragged batch stored in a paged cache, plus the same K/V kept contiguous per sequence."""

    query: torch.Tensor  # (T, Hq, D), T includes padded query rows
    key_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    query_start_loc: torch.Tensor  # (S + 1,) int32
    seq_lens: torch.Tensor  # (S,) int32
    block_tables: torch.Tensor  # (S, max_blocks) int32, unused entries -1
    keys: list[torch.Tensor]  # per sequence (seq_len, Hkv, D)
    values: list[torch.Tensor]  # per sequence (seq_len, Hkv, D)
    num_real_tokens: int

    def metadata(self) -> dict:
        return dict(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            scale=HEAD_SIZE**-0.5,
        )


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_padded_tokens: int = 0,
) -> PagedBatch:
    """Random K/V for each sequence, scattered into randomly chosen (shuffled) cache blocks.

    Built on the CPU, then moved to DEVICE (the CPU when the kernels are interpreted).
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(max(blocks_per_seq), 1) + 1  # one spare column, like a runner's table
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    free_blocks = torch.randperm(num_blocks).tolist()
    shape = (num_blocks, block_size, num_kv_heads, HEAD_SIZE)
    key_cache, value_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    keys, values = [], []
    for seq_idx, (seq_len, num_seq_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        block_ids = [free_blocks.pop() for _ in range(num_seq_blocks)]
        block_tables[seq_idx, :num_seq_blocks] = torch.tensor(block_ids, dtype=torch.int32)
        keys.append(key_cache[block_ids].flatten(0, 1)[:seq_len])
        values.append(value_cache[block_ids].flatten(0, 1)[:seq_len])
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    num_tokens = starts[-1] + num_padded_tokens
    return PagedBatch(
        query=torch.randn(num_tokens, num_heads, HEAD_SIZE).to(dtype).to(DEVICE),
        key_cache=key_cache.to(DEVICE),
        value_cache=value_cache.to(DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        keys=[key.to(DEVICE) for key in keys],
        values=[value.to(DEVICE) for value in values],
        num_real_tokens=starts[-1],
    )


def dense_causal_attention(query, key, value, scale):
    """Float64 causal attention over contiguous (seq_len, Hkv, D) K/V; returns (q_len, Hq, D)."""
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    kv_head_of = torch.arange(num_heads, device=key.device) // (num_heads // num_kv_heads)  # (Hq,)
    key, value = key.double()[:, kv_head_of], value.double()[:, kv_head_of]  # (seq_len, Hq, D)
    scores = torch.einsum("ihd,jhd->hij", query.double(), key) * scale  # (Hq, q_len, seq_len)
    # The last query row sits at position seq_len - 1, so row i sees keys j <= i + seq_len - q_len.
    allowed = torch.ones(query_len, seq_len, dtype=torch.bool, device=key.device)
    allowed = allowed.tril(seq_len - query_len)  # (q_len, seq_len)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hij,jhd->ihd", weights, value)


def run_reference(batch: PagedBatch) -> torch.Tensor:
    output = torch.full_like(batch.query, SENTINEL)
    paged_attention_reference(
        batch.query, batch.key_cache, batch.value_cache, output, **batch.metadata()
    )
    return output


def run_triton(batch: PagedBatch, max_query_len: int, **kwargs) -> torch.Tensor:
    output = torch.full_like(batch.query, SENTINEL)
    paged_attention_triton(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        output,
        **batch.metadata(),
        max_query_len=max_query_len,
        **kwargs,
    )
    return output


def assert_matches_reference(batch: PagedBatch, output: torch.Tensor) -> None:
    """Every real row equals the reference; padded query rows still hold the poison."""
    expected = run_reference(batch)
    real = batch.num_real_tokens
    assert torch.isfinite(output[:real]).all(), "a real row holds NaN/inf"
    assert (output[:real] != SENTINEL).any(dim=(1, 2)).all(), "a real row was never written"
    torch.testing.assert_close(output[:real], expected[:real], **TOLERANCES[output.dtype])
    assert (output[real:] == SENTINEL).all(), "a padded query row was written"


# ---------------------------------------------------------------- reference vs dense attention

REFERENCE_CASES = {
    "prefill": ([23, 40, 7], [23, 40, 7]),
    "decode": ([1, 17, 64, 90], [1, 1, 1, 1]),
    "mixed": ([50, 33, 9, 70], [1, 12, 9, 1]),  # decode, chunked prefill, prefill, decode
}


@pytest.mark.parametrize("case", REFERENCE_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_reference_matches_dense_attention(case, num_heads, num_kv_heads, block_size):
    seq_lens, query_lens = REFERENCE_CASES[case]
    batch = make_batch(
        seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size
    )
    output = run_reference(batch)
    starts = batch.query_start_loc.tolist()
    for seq_idx in range(len(seq_lens)):
        rows = slice(starts[seq_idx], starts[seq_idx + 1])
        expected = dense_causal_attention(
            batch.query[rows], batch.keys[seq_idx], batch.values[seq_idx], HEAD_SIZE**-0.5
        )
        torch.testing.assert_close(output[rows].double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_skips_padding_and_zeroes_rows_without_keys():
    # Sequence 1 is runner padding (seq_len 0, no query); sequence 2 has a query but no key.
    batch = make_batch([5, 0, 0], [2, 0, 1], num_padded_tokens=2)
    output = run_reference(batch)
    assert torch.isfinite(output).all()
    assert (output[2] == 0).all(), "a query that sees no key must give zeros"
    assert (output[3:] == SENTINEL).all(), "padded query rows must be left untouched"


# ---------------------------------------------------------------- store_kv_cache

STORE_IMPLS = {"torch": store_kv_cache_torch, "triton": store_kv_cache_triton}
STORE_IMPL_PARAMS = ["torch", pytest.param("triton", marks=requires_triton)]


@pytest.mark.parametrize("impl", STORE_IMPL_PARAMS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_cache_writes_exactly_the_given_slots(impl, cache_dtype, block_size):
    num_blocks, num_kv_heads, num_tokens = 6, 2, 12
    num_slots = num_blocks * block_size
    slot_mapping = torch.randperm(num_slots, device=DEVICE)[:num_tokens]
    slot_mapping[[3, 7, 11]] = -1  # padded tokens
    # key/value as slices of one fused buffer, like a qkv projection's output: strided rows.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, HEAD_SIZE, device=DEVICE)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    shape = (num_blocks, block_size, num_kv_heads, HEAD_SIZE)
    key_cache = torch.full(shape, SENTINEL, dtype=cache_dtype, device=DEVICE)
    value_cache = torch.full(shape, -SENTINEL, dtype=cache_dtype, device=DEVICE)

    STORE_IMPLS[impl](key, value, key_cache, value_cache, slot_mapping)

    flat_keys, flat_values = key_cache.flatten(0, 1), value_cache.flatten(0, 1)  # (num_slots, ...)
    is_real = slot_mapping >= 0
    written = slot_mapping[is_real]
    torch.testing.assert_close(flat_keys[written], key[is_real].to(cache_dtype), atol=0, rtol=0)
    torch.testing.assert_close(flat_values[written], value[is_real].to(cache_dtype), atol=0, rtol=0)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert (flat_keys[untouched] == SENTINEL).all(), "a slot outside slot_mapping was written"
    assert (flat_values[untouched] == -SENTINEL).all(), "a slot outside slot_mapping was written"


@pytest.mark.parametrize("impl", STORE_IMPL_PARAMS)
def test_store_kv_cache_all_padding_writes_nothing(impl):
    key = torch.randn(4, 2, HEAD_SIZE, device=DEVICE)
    key_cache = torch.full((2, 16, 2, HEAD_SIZE), SENTINEL, device=DEVICE)
    value_cache = torch.full((2, 16, 2, HEAD_SIZE), SENTINEL, device=DEVICE)
    slot_mapping = torch.full((4,), -1, device=DEVICE)
    STORE_IMPLS[impl](key, key.clone(), key_cache, value_cache, slot_mapping)
    assert (key_cache == SENTINEL).all() and (value_cache == SENTINEL).all()


# ---------------------------------------------------------------- Triton attention vs reference

DTYPES = [torch.float32, torch.float16]
GQA = [(4, 4), (8, 2)]  # (Hq, Hkv): ratio 1 and ratio 4


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_decode_matches_reference(dtype, num_heads, num_kv_heads, block_size):
    # Context lengths: 1, off the block grid, exactly one block, shorter and longer than a tile.
    seq_lens = [1, 15, 16, 33, 100, 200]
    batch = make_batch(seq_lens, [1] * len(seq_lens), num_heads=num_heads,
                       num_kv_heads=num_kv_heads, block_size=block_size, dtype=dtype)  # fmt: skip
    assert_matches_reference(batch, run_triton(batch, max_query_len=1))


@requires_triton
@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
def test_triton_decode_split_counts(num_kv_splits):
    # 8 splits of a 200-token context leave trailing splits empty (tiles are 64 tokens).
    batch = make_batch([200, 70, 5, 129], [1, 1, 1, 1], num_heads=8, num_kv_heads=2)
    assert_matches_reference(batch, run_triton(batch, max_query_len=1, num_kv_splits=num_kv_splits))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_prefill_matches_reference(dtype, num_heads, num_kv_heads, block_size):
    seq_lens = [40, 7, 70]
    batch = make_batch(seq_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       block_size=block_size, dtype=dtype)  # fmt: skip
    assert_matches_reference(batch, run_triton(batch, max_query_len=max(seq_lens)))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, block_size):
    # Decode rows, a chunked prefill with context, a whole prefill, another decode row.
    seq_lens, query_lens = [50, 75, 19, 33], [1, 21, 19, 1]
    batch = make_batch(seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       block_size=block_size, dtype=dtype)  # fmt: skip
    assert_matches_reference(batch, run_triton(batch, max_query_len=max(query_lens)))


@requires_triton
@pytest.mark.parametrize("max_query_len", [1, 9])
def test_triton_padded_sequences_and_rows(max_query_len):
    # Two trailing padded sequences (seq_len 0, query len 0) and three padded query rows, as
    # the runner leaves them when it pads a batch up to a captured size.
    query_lens = [1, max_query_len, 1, 0, 0]
    batch = make_batch([30, 45, 64, 0, 0], query_lens, num_heads=8, num_kv_heads=2,
                       num_padded_tokens=3)  # fmt: skip
    assert_matches_reference(batch, run_triton(batch, max_query_len=max_query_len))


@requires_triton
def test_triton_prefill_blocks_numbered_over_the_flattened_batch():
    # A general FULL graph's layout: max_query_len is the captured token count, many short and
    # padded sequences beside one long prompt whose blocks start mid-block; every query is
    # found by the program its flattened block number gives, and the grid is T // BLOCK_Q + S.
    query_lens = [1, 3, 1, 37, 1, 2, 0, 0, 1, 0]
    seq_lens = [9, 20, 33, 50, 5, 2, 0, 0, 70, 0]
    batch = make_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, num_padded_tokens=4)
    num_tokens = batch.query.shape[0]
    assert_matches_reference(batch, run_triton(batch, max_query_len=num_tokens))
    plan = triton_attention.plan_paged_attention
    launch = plan(batch.query, batch.key_cache, batch.value_cache, torch.empty_like(batch.query),
                  block_tables=batch.block_tables, scale=0.5, max_query_len=num_tokens)  # fmt: skip
    block_q = launch.options["BLOCK_Q"]
    assert launch.grid == (num_tokens // block_q + len(seq_lens), 2)


@requires_triton
@pytest.mark.parametrize("max_query_len", [1, 4])
def test_triton_query_without_keys_gives_zeros(max_query_len):
    # A padded sequence with one query row but seq_len 0 sees no key: zeros, never NaN.
    batch = make_batch([20, 0], [1, 1], num_heads=8, num_kv_heads=2)
    output = run_triton(batch, max_query_len=max_query_len)
    assert (output[1] == 0).all()
    assert_matches_reference(batch, output)


@requires_triton
@pytest.mark.parametrize("max_query_len", [1, 6])
def test_triton_strided_query_and_output(max_query_len):
    # query and output as head slices of wider buffers (e.g. a fused qkv projection).
    batch = make_batch([37, 64], [1, max_query_len], num_heads=4, num_kv_heads=2)
    batch.query = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)[:, :4]
    wide_output = torch.full((batch.query.shape[0], 8, HEAD_SIZE), SENTINEL, device=DEVICE)
    output = wide_output[:, 2:6]
    paged_attention_triton(batch.query, batch.key_cache, batch.value_cache, output,
                           **batch.metadata(), max_query_len=max_query_len)  # fmt: skip
    assert_matches_reference(batch, output)
    assert (wide_output[:, :2] == SENTINEL).all() and (wide_output[:, 6:] == SENTINEL).all()


@requires_triton
def test_triton_decode_rereads_metadata_in_place():
    # Graph replay reuses the same buffers with new values: nothing may be cached host-side.
    batch = make_batch([90, 12], [1, 1], num_heads=8, num_kv_heads=2)
    first = run_triton(batch, max_query_len=1)
    assert_matches_reference(batch, first)
    batch.seq_lens.copy_(torch.tensor([13, 80], dtype=torch.int32, device=DEVICE))
    batch.block_tables.copy_(batch.block_tables.flip(0))  # sequences swap their blocks
    batch.query.copy_(torch.randn_like(batch.query))
    assert_matches_reference(batch, run_triton(batch, max_query_len=1))


@requires_triton
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_triton_decode_single_split_writes_the_output_itself(num_kv_splits):
    # One split per (seq, kv head) is the whole result: no reduce launch and no scratch.
    from pieceworks.models.attention.ops import DecodeWorkspace, plan_paged_attention

    batch = make_batch([200, 70], [1, 1], num_heads=8, num_kv_heads=2)
    workspace = DecodeWorkspace()
    output = torch.full_like(batch.query, SENTINEL)
    launch = plan_paged_attention(batch.query, batch.key_cache, batch.value_cache, output,
                                  block_tables=batch.block_tables, scale=HEAD_SIZE**-0.5,
                                  max_query_len=1, num_kv_splits=num_kv_splits,
                                  workspace=workspace)  # fmt: skip
    launch(batch.query, batch.key_cache, batch.value_cache, output, batch.query_start_loc,
           batch.seq_lens, batch.block_tables)  # fmt: skip
    assert_matches_reference(batch, output)
    assert (launch.reduce is None) == (num_kv_splits == 1)
    assert (workspace._views == {}) == (num_kv_splits == 1)


@requires_triton
def test_triton_decode_empty_splits_write_nothing_and_are_not_read():
    # 8 splits of 64-token tiles: the 200-token context uses splits 0-3, the 5-token one split 0.
    # The others exit before their wait; the reduce must not read their (here NaN) rows.
    from pieceworks.models.attention.ops import DecodeWorkspace, plan_paged_attention

    batch = make_batch([200, 5], [1, 1], num_heads=8, num_kv_heads=2)
    output = torch.full_like(batch.query, SENTINEL)
    launch = plan_paged_attention(batch.query, batch.key_cache, batch.value_cache, output,
                                  block_tables=batch.block_tables, scale=HEAD_SIZE**-0.5,
                                  max_query_len=1, num_kv_splits=8,
                                  workspace=DecodeWorkspace())  # fmt: skip
    launch.partial_out.fill_(float("nan"))
    launch.partial_lse.fill_(float("nan"))
    launch(batch.query, batch.key_cache, batch.value_cache, output, batch.query_start_loc,
           batch.seq_lens, batch.block_tables)  # fmt: skip
    assert_matches_reference(batch, output)
    used = torch.zeros(2, 1, 8, dtype=torch.bool, device=DEVICE)  # (seq, head, split)
    used[0, :, :4] = used[1, :, :1] = True
    assert launch.partial_lse[used.expand(2, 8, 8)].isfinite().all()
    assert launch.partial_lse[~used.expand(2, 8, 8)].isnan().all()
    assert launch.partial_out[~used.expand(2, 8, 8)].isnan().all()


@requires_triton
@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
def test_triton_decode_peeled_first_tile_gives_the_same_bytes(num_kv_splits):
    # Launched early, the split kernel loads its first tile before its wait and attends it before
    # the loop (PEEL_FIRST_TILE): the same tiles in the same order as the plain loop, so the same
    # output, bit for bit, with splits of several tiles, of one, of less than one, and empty ones.
    # (Forced here without PDL, which never runs interpreted.)
    import dataclasses

    from pieceworks.models.attention.ops import DecodeWorkspace, plan_paged_attention

    batch = make_batch([200, 70, 1, 64], [1, 1, 1, 1], num_heads=8, num_kv_heads=2)
    outputs = []
    for peel in (False, True):
        output = torch.full_like(batch.query, SENTINEL)
        launch = plan_paged_attention(batch.query, batch.key_cache, batch.value_cache, output,
                                      block_tables=batch.block_tables, scale=HEAD_SIZE**-0.5,
                                      max_query_len=1, num_kv_splits=num_kv_splits,
                                      workspace=DecodeWorkspace())  # fmt: skip
        options = {**launch.split.options, "PEEL_FIRST_TILE": peel}
        launch = dataclasses.replace(
            launch, split=dataclasses.replace(launch.split, options=options)
        )
        launch(batch.query, batch.key_cache, batch.value_cache, output, batch.query_start_loc,
               batch.seq_lens, batch.block_tables)  # fmt: skip
        outputs.append(output)
    assert_matches_reference(batch, outputs[1])
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_triton_decode_launches_early_under_pdl(monkeypatch, pdl, num_kv_splits):
    # Under PDL the split kernel is launched early (it loads its first K/V tile, then waits for
    # q) and lets the reduce be scheduled as it waits; the reduce is launched early too.
    # Without it both launch after their producer. (Planning only: PDL never runs on the CPU.)
    from pieceworks.models.attention.ops import DecodeWorkspace, plan_paged_attention

    monkeypatch.setattr(triton_attention, "programmatic_launch", lambda device: pdl)
    batch = make_batch([200, 70], [1, 1], num_heads=8, num_kv_heads=2)
    launch = plan_paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.query,
                                  block_tables=batch.block_tables, scale=HEAD_SIZE**-0.5,
                                  max_query_len=1, num_kv_splits=num_kv_splits,
                                  workspace=DecodeWorkspace())  # fmt: skip
    split = launch.split.options
    assert split["PDL"] is pdl and split.get("launch_pdl", False) is pdl
    assert split["PEEL_FIRST_TILE"] is pdl  # its first tile loads before the wait
    if num_kv_splits > 1:
        assert launch.reduce.options["PDL"] is pdl
        assert launch.reduce.options.get("launch_pdl", False) is pdl


@requires_triton
@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_decode_with_fused_kv_store(num_kv_splits, block_size):
    """The decode plan that stores the step's K/V itself (``new_kv``) gives the output and the
    cache of "store, then attend": each sequence's new token lands in its slot and is attended
    to, padded sequences and padded rows (slot -1) write nothing, every other cache row keeps its
    value, and no split reads a row written in the same launch (the new K/V come from registers).
    """
    from pieceworks.models.attention.ops import plan_paged_attention

    seq_lens = [1, 15, 33, 100, 0]
    batch = make_batch(seq_lens, [1, 1, 1, 1, 0], num_heads=8, num_kv_heads=2,
                       block_size=block_size, num_padded_tokens=2)  # fmt: skip
    num_tokens = batch.query.shape[0]
    key = torch.randn(num_tokens, 2, HEAD_SIZE, device=DEVICE)
    value = torch.randn(num_tokens, 2, HEAD_SIZE, device=DEVICE)
    slots = [-1] * num_tokens
    for seq, seq_len in enumerate(seq_lens):
        if seq_len:  # the token at position seq_len - 1 of sequence seq is row seq
            block = int(batch.block_tables[seq, (seq_len - 1) // block_size])
            slots[seq] = block * block_size + (seq_len - 1) % block_size
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)

    expected_keys, expected_values = batch.key_cache.clone(), batch.value_cache.clone()
    store_kv_cache_torch(key, value, expected_keys, expected_values, slot_mapping)
    expected = torch.full_like(batch.query, SENTINEL)
    paged_attention_reference(batch.query, expected_keys, expected_values, expected,
                              **batch.metadata())  # fmt: skip

    output = torch.full_like(batch.query, SENTINEL)
    metadata = batch.metadata()
    launch = plan_paged_attention(
        batch.query, batch.key_cache, batch.value_cache, output, block_tables=batch.block_tables,
        scale=metadata["scale"], max_query_len=1, num_kv_splits=num_kv_splits,
        new_kv=(key, value),
    )  # fmt: skip
    assert launch is not None and launch.stores_kv
    launch(batch.query, batch.key_cache, batch.value_cache, output, batch.query_start_loc,
           batch.seq_lens, batch.block_tables, new_kv=(key, value, slot_mapping))  # fmt: skip
    real = batch.num_real_tokens
    torch.testing.assert_close(output[:real], expected[:real], **TOLERANCES[torch.float32])
    assert (output[real:] == SENTINEL).all()
    assert torch.equal(batch.key_cache, expected_keys)
    assert torch.equal(batch.value_cache, expected_values)


# ---------------------------------------------------------------- FP8 output

# Attention outputs here are mixes of randn V rows, up to about 3: with this scale the largest
# saturate at 448 * scale = 1.34.
OUTPUT_SCALE = 0.003


def run_triton_fp8(batch: PagedBatch, max_query_len: int, **kwargs) -> torch.Tensor:
    """The Triton attention with an FP8 output; rows start as NaN (no real row can be NaN)."""
    output = torch.full_like(batch.query, float("nan")).to(KERNEL_FP8_DTYPE)
    scale = torch.tensor(OUTPUT_SCALE, device=DEVICE)
    paged_attention_triton(batch.query, batch.key_cache, batch.value_cache, output,
                           **batch.metadata(), max_query_len=max_query_len, output_scale=scale,
                           **kwargs)  # fmt: skip
    return output


def assert_fp8_output(batch: PagedBatch, output: torch.Tensor, max_query_len: int, **kwargs):
    """Real rows: byte for byte ``static_scaled_fp8_quant`` of the unquantized kernel's output,
    and close to the quantized reference."""
    scale = torch.tensor(OUTPUT_SCALE, device=DEVICE)
    real = batch.num_real_tokens
    unfused = static_scaled_fp8_quant(run_triton(batch, max_query_len, **kwargs), scale)[:real]
    assert torch.equal(output[:real].view(torch.uint8), unfused.view(torch.uint8))
    expected = static_scaled_fp8_quant(run_reference(batch), scale)[:real].float()
    actual = output[:real].float()
    assert (expected.abs() == KERNEL_FP8_MAX).any(), "no value saturates: choose a smaller scale"
    # The kernel and the reference differ before quantization (float16: by TOLERANCES, as the
    # kernel multiplies float16 probabilities); a value near an e4m3 rounding boundary then lands
    # one e4m3 step away (2^-3 relative), and near zero the kernel's own error, scaled, remains.
    same = (actual == expected).float().mean()
    assert same >= 0.97, f"only {same:.3f} of the FP8 values equal the quantized reference"
    atol = TOLERANCES[batch.query.dtype]["atol"] / OUTPUT_SCALE
    torch.testing.assert_close(actual, expected, rtol=2**-3, atol=atol)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
def test_triton_decode_fp8_output_is_fused_quantization(dtype, num_heads, num_kv_heads,
                                                        num_kv_splits):  # fmt: skip
    # A padded sequence (seq_len 0, no query) and two padded rows, as a captured size leaves them.
    seq_lens = [1, 15, 33, 100, 200, 0]
    batch = make_batch(seq_lens, [1, 1, 1, 1, 1, 0], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, dtype=dtype, num_padded_tokens=2)  # fmt: skip
    output = run_triton_fp8(batch, max_query_len=1, num_kv_splits=num_kv_splits)
    assert output.dtype == KERNEL_FP8_DTYPE
    assert_fp8_output(batch, output, max_query_len=1, num_kv_splits=num_kv_splits)
    real = batch.num_real_tokens
    assert not output[:real].float().isnan().any(), "a real row was never written"
    assert output[real:].float().isnan().all(), "a padded query row was written"


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["prefill", "mixed"])
def test_triton_prefill_and_mixed_fp8_output(dtype, case):
    seq_lens, query_lens = {"prefill": ([40, 7, 70], [40, 7, 70]),
                            "mixed": ([50, 75, 19, 33], [1, 21, 19, 1])}[case]  # fmt: skip
    batch = make_batch(seq_lens, query_lens, num_heads=8, num_kv_heads=2, dtype=dtype)
    output = run_triton_fp8(batch, max_query_len=max(query_lens))
    assert output.dtype == KERNEL_FP8_DTYPE
    assert_fp8_output(batch, output, max_query_len=max(query_lens))


@requires_triton
@pytest.mark.parametrize("max_query_len", [1, 4])
def test_output_dtype_must_match_the_quantization(max_query_len):
    batch = make_batch([20, 9], [1, 1], num_heads=8, num_kv_heads=2)
    scale = torch.tensor(OUTPUT_SCALE, device=DEVICE)
    fp8_output = torch.empty_like(batch.query, dtype=KERNEL_FP8_DTYPE)
    args = (batch.query, batch.key_cache, batch.value_cache)
    with pytest.raises(ValueError, match="float8_e4m3fn exactly when"):
        paged_attention_triton(*args, fp8_output, **batch.metadata(), max_query_len=max_query_len)
    with pytest.raises(ValueError, match="float8_e4m3fn exactly when"):
        paged_attention_triton(*args, torch.empty_like(batch.query), **batch.metadata(),
                               max_query_len=max_query_len, output_scale=scale)  # fmt: skip
