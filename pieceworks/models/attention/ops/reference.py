"""Paged attention in plain torch: the oracle for the Triton kernels and the CPU backend.

Owns `paged_attention_reference`, which defines the semantics every attention kernel in pieceworks
must match. One batch is a list of ragged sequences: sequence s owns query rows
`query_start_loc[s] : query_start_loc[s + 1]` and a context of `seq_lens[s]` tokens that already
includes those new query tokens (their K/V were stored before attention runs). Query token i of a
sequence with q_s query tokens sits at absolute position `seq_lens[s] - q_s + i` and attends
causally to cache positions `0 .. position`; with a sliding window `W` only to the last `W` of
them, `position - W + 1 .. position` (Mistral's and Gemma's `sliding_window`, as transformers masks
it); block-table entries wholly before the first query's window are never read (the scheduler may
have freed those blocks). Prefill, decode (q_s = 1) and mixed batches are all this one rule.
Padded sequences (query length 0) are skipped; rows past `query_start_loc[-1]` are left untouched;
a query row that can see no key (a padded sequence with seq_len 0) gets zeros.

It loops over sequences on the host (`.tolist()`), so it is neither fast nor graph-capturable; it
does not own the cache layout (`kv_cache.py`) or the fast path (`triton_attention.py`).
"""

import torch


def paged_attention_reference(
    query: torch.Tensor,  # (T, Hq, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    output: torch.Tensor,  # (T, Hq, D), written in place
    *,
    query_start_loc: torch.Tensor,  # (S + 1,) int32
    seq_lens: torch.Tensor,  # (S,) int32, context length including the new query tokens
    block_tables: torch.Tensor,  # (S, max_blocks) int32
    scale: float,
    sliding_window: int | None = None,  # None: the whole context
) -> None:
    """Causal (optionally sliding-window) paged attention in float32, one sequence at a time."""
    starts = query_start_loc.tolist()
    for seq_idx, seq_len in enumerate(seq_lens.tolist()):
        query_start, query_end = starts[seq_idx], starts[seq_idx + 1]
        if query_end == query_start:  # padded sequence: no query rows to write
            continue
        block_table, num_dead = block_tables[seq_idx], 0
        if sliding_window is not None:  # blocks before every query's window may have been freed
            first_visible = max(seq_len - (query_end - query_start) - sliding_window + 1, 0)
            num_dead = first_visible // key_cache.shape[1] * key_cache.shape[1]  # whole blocks
            block_table = block_table.clone()
            block_table[: num_dead // key_cache.shape[1]] = 0  # read, then zeroed: masked anyway
        key, value = gather_context(key_cache, value_cache, block_table, seq_len)
        key[:num_dead], value[:num_dead] = 0.0, 0.0  # (copies: the cache is untouched)
        output[query_start:query_end] = _attend_one_sequence(
            query[query_start:query_end].float(), key, value, seq_len, scale, sliding_window
        ).to(output.dtype)


def gather_context(
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_table: torch.Tensor,  # (max_blocks,) int32, one sequence's row
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one sequence's first `seq_len` K/V rows through its block table, as float32."""
    block_size = key_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    block_ids = block_table[:num_blocks].long()  # (num_blocks,)
    key = key_cache[block_ids].flatten(0, 1)[:seq_len]  # (seq_len, Hkv, D)
    value = value_cache[block_ids].flatten(0, 1)[:seq_len]  # (seq_len, Hkv, D)
    return key.float(), value.float()


def _attend_one_sequence(
    query: torch.Tensor,  # (q_len, Hq, D) float32
    key: torch.Tensor,  # (seq_len, Hkv, D) float32
    value: torch.Tensor,  # (seq_len, Hkv, D) float32
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal softmax attention of one sequence's queries over its context; (q_len, Hq, D)."""
    query_len, num_heads, _ = query.shape
    num_queries_per_kv = num_heads // key.shape[1]
    key = key.repeat_interleave(num_queries_per_kv, dim=1)  # (seq_len, Hq, D)
    value = value.repeat_interleave(num_queries_per_kv, dim=1)  # (seq_len, Hq, D)

    scores = torch.einsum("qhd,khd->hqk", query, key) * scale  # (Hq, q_len, seq_len)
    query_pos = seq_len - query_len + torch.arange(query_len, device=query.device)  # (q_len,)
    key_pos = torch.arange(seq_len, device=query.device)  # (seq_len,)
    visible = key_pos[None, :] <= query_pos[:, None]  # (q_len, seq_len)
    if sliding_window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))

    # A row that sees no key (query position < 0) would softmax to NaN; it gets zeros instead.
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # (Hq, q_len, seq_len)
    return torch.einsum("hqk,khd->qhd", probs, value)  # (q_len, Hq, D)
