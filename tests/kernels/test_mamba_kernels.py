"""Mamba2 mixer-core ops: references match HF Bamba; Triton kernels match the references.

Proves, on CPU under the Triton interpreter with small float32 shapes:
- the torch references composed (conv -> scan -> gated norm) reproduce HF's ``BambaMixer``, and the
  scan / conv references match HF's chunk scan and conv update including carried-in states;
- ``causal_conv1d_varlen`` and ``mamba_chunk_scan_varlen`` match the references on a ragged packed
  batch (lengths not multiples of the chunk, shorter than d_conv, zero), with and without states;
- a chunked prefill split at unaligned points equals the unsplit run;
- decoding token by token (``causal_conv1d_update`` + ``selective_state_update``) equals prefill;
- padded rows (null slot, negative slot, zero-length sequence) leave every other slot untouched,
  and every real output row is written (outputs are NaN-poisoned first).

Run: PYTHONPATH=. python -m pytest tests/kernels/test_mamba_kernels.py -q
"""

import pytest
import torch

from pieceworks.models.mamba.ops import (
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_varlen,
    gated_rms_norm_ref,
    mamba_chunk_scan_varlen,
    selective_state_update,
    ssm_scan_ref,
)

# The conftest runs Triton under its CPU interpreter when no GPU is visible; with a GPU these
# CPU-tensor tests would hand CPU tensors to compiled kernels (test_mamba_kernels_gpu.py covers it).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests")

NUM_HEADS, HEAD_DIM, NUM_GROUPS, D_STATE, D_CONV = 4, 16, 2, 8, 4
INTERMEDIATE = NUM_HEADS * HEAD_DIM
CONV_DIM = INTERMEDIATE + 2 * NUM_GROUPS * D_STATE
NUM_SLOTS = 6
CHUNK_SIZE = 16
ATOL, RTOL = 1e-4, 1e-4


def _query_start_loc(seq_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist(), dtype=torch.int32)


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _mixer_params(seed: int) -> dict[str, torch.Tensor]:
    """Random conv and SSM parameters, A negative as -exp(A_log)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "conv_weight": torch.randn(CONV_DIM, D_CONV, generator=gen) * 0.5,
        "conv_bias": torch.randn(CONV_DIM, generator=gen) * 0.1,
        "A": -torch.exp(torch.rand(NUM_HEADS, generator=gen) * 1.5),
        "D": torch.randn(NUM_HEADS, generator=gen),
        "dt_bias": torch.randn(NUM_HEADS, generator=gen) * 0.5 - 1.0,
    }


def _fresh_states(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (conv_state, ssm_state) caches for NUM_SLOTS slots."""
    gen = torch.Generator().manual_seed(seed)
    conv_state = torch.randn(NUM_SLOTS, CONV_DIM, D_CONV - 1, generator=gen)
    ssm_state = torch.randn(NUM_SLOTS, NUM_HEADS, HEAD_DIM, D_STATE, generator=gen)
    return conv_state, ssm_state


def _split_xBC(xBC: torch.Tensor):
    """(T, conv_dim) -> strided views x (T, H, P), B (T, G, N), C (T, G, N), as the mixer does."""
    x, B, C = xBC.split([INTERMEDIATE, NUM_GROUPS * D_STATE, NUM_GROUPS * D_STATE], dim=-1)
    num_tokens = xBC.shape[0]
    return (
        x.view(num_tokens, NUM_HEADS, HEAD_DIM),
        B.view(num_tokens, NUM_GROUPS, D_STATE),
        C.view(num_tokens, NUM_GROUPS, D_STATE),
    )


def _mixer_core(ops: str, xBC, dt, p, conv_state, ssm_state, qsl, slots, has_initial):
    """conv -> split -> scan with either the references or the Triton prefill kernels."""
    conv = causal_conv1d_ref if ops == "ref" else causal_conv1d_varlen
    scan = ssm_scan_ref if ops == "ref" else mamba_chunk_scan_varlen
    conv_args = (conv_state, qsl, slots, has_initial)
    xBC = conv(xBC, p["conv_weight"], p["conv_bias"], *conv_args)
    x, B, C = _split_xBC(xBC)
    kwargs = {} if ops == "ref" else {"chunk_size": CHUNK_SIZE}
    scan_args = (ssm_state, qsl, slots, has_initial)
    return scan(x, dt, p["A"], B, C, p["D"], p["dt_bias"], *scan_args, **kwargs)


# ---------------------------------------------------------------- references vs HF transformers


def _tiny_bamba_mixer():
    from transformers.models.bamba.configuration_bamba import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaMixer

    config = BambaConfig(
        hidden_size=INTERMEDIATE // 2, mamba_expand=2, mamba_n_heads=NUM_HEADS,
        mamba_d_head=HEAD_DIM, mamba_n_groups=NUM_GROUPS, mamba_d_state=D_STATE,
        mamba_d_conv=D_CONV, mamba_chunk_size=CHUNK_SIZE, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5,
    )  # fmt: skip
    mixer = BambaMixer(config, layer_idx=0).eval()
    with torch.no_grad():
        mixer.A_log.uniform_(-1.0, 1.5)
        mixer.D.normal_()
        mixer.dt_bias.normal_(-1.0, 0.5)
        mixer.norm.weight.normal_(1.0, 0.2)
    return mixer


@torch.no_grad()
def test_reference_pieces_reproduce_hf_bamba_mixer():
    torch.manual_seed(0)
    mixer = _tiny_bamba_mixer()
    num_tokens = 37  # not a multiple of HF's chunk size
    hidden = torch.randn(1, num_tokens, mixer.hidden_size)
    expected = mixer(hidden)[0]  # (T, hidden)

    gate, xBC, dt = mixer.in_proj(hidden[0]).split([INTERMEDIATE, CONV_DIM, NUM_HEADS], dim=-1)
    conv_state, ssm_state = _fresh_states(seed=1)
    meta = (_query_start_loc([num_tokens]), _ints([3]), torch.tensor([False]))
    conv_out = causal_conv1d_ref(
        xBC, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, conv_state, *meta
    )
    x, B, C = _split_xBC(conv_out)
    A = -torch.exp(mixer.A_log.float())
    y = ssm_scan_ref(x, dt, A, B, C, mixer.D, mixer.dt_bias, ssm_state, *meta)
    normed = gated_rms_norm_ref(y.reshape(num_tokens, INTERMEDIATE), gate, mixer.norm.weight,
                                mixer.norm.variance_epsilon, NUM_GROUPS)  # fmt: skip
    torch.testing.assert_close(mixer.out_proj(normed), expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(conv_state[3], xBC[-(D_CONV - 1) :].t())


@torch.no_grad()
def test_ssm_scan_ref_matches_hf_chunk_scan_with_initial_state():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    torch.manual_seed(0)
    p, num_tokens = _mixer_params(seed=2), 29
    x, dt = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM), torch.randn(num_tokens, NUM_HEADS)
    B, C = torch.randn(2, num_tokens, NUM_GROUPS, D_STATE).unbind(0)
    _, ssm_state = _fresh_states(seed=3)
    initial = ssm_state[1].clone()
    meta = (_query_start_loc([num_tokens]), _ints([1]), torch.tensor([True]))
    y = ssm_scan_ref(x, dt, p["A"], B, C, p["D"], p["dt_bias"], ssm_state, *meta)
    y_hf, final_hf = mamba2_chunk_scan(
        x[None], dt[None], p["A"], B[None], C[None], chunk_size=8, D=p["D"],
        dt_bias=p["dt_bias"], initial_states=initial[None], dt_softplus=True,
        return_final_states=True,
    )  # fmt: skip
    torch.testing.assert_close(y, y_hf[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ssm_state[1], final_hf[0], atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_conv_ref_continuation_matches_hf_conv_update():
    from transformers.models.bamba.modeling_bamba import causal_conv1d_update as hf_conv_update

    torch.manual_seed(0)
    p = _mixer_params(seed=4)
    conv_state, _ = _fresh_states(seed=5)
    hf_state = conv_state[2:3].clone()  # (1, conv_dim, d_conv - 1)
    tokens = torch.randn(2, CONV_DIM)  # shorter than d_conv - 1: old cache entries shift through
    meta = (_query_start_loc([2]), _ints([2]), torch.tensor([True]))
    out = causal_conv1d_ref(tokens, p["conv_weight"], p["conv_bias"], conv_state, *meta)
    for t in range(2):
        hf_out = hf_conv_update(tokens[t, :, None][None], hf_state, p["conv_weight"],
                                p["conv_bias"], activation="silu")  # fmt: skip
        torch.testing.assert_close(out[t], hf_out[0, :, 0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(conv_state[2], hf_state[0])


# ---------------------------------------------------------------- Triton prefill vs references

SEQ_LENS = [19, 2, 37, 0]  # unaligned to CHUNK_SIZE, shorter than d_conv, and a padded sequence
SLOTS = [4, 1, 2, 0]  # slot 0 is the null slot of the padded sequence


@pytest.mark.parametrize("has_initial", [[False] * 4, [True] * 4, [True, False, True, True]])
@torch.no_grad()
def test_varlen_prefill_matches_reference(has_initial):
    torch.manual_seed(len(has_initial) + sum(has_initial))
    p, num_tokens = _mixer_params(seed=6), sum(SEQ_LENS)
    xBC, dt = torch.randn(num_tokens, CONV_DIM), torch.randn(num_tokens, NUM_HEADS)
    meta = (_query_start_loc(SEQ_LENS), _ints(SLOTS), torch.tensor(has_initial))
    ref_states, states = _fresh_states(seed=7), _fresh_states(seed=7)
    y_ref = _mixer_core("ref", xBC, dt, p, *ref_states, *meta)
    y = _mixer_core("triton", xBC, dt, p, *states, *meta)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=RTOL)
    for ref_state, state in zip(ref_states, states):
        torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=RTOL)  # untouched slots too


@torch.no_grad()
def test_prefill_kernels_write_every_row_and_handle_missing_bias_and_skip():
    torch.manual_seed(1)
    p, num_tokens = _mixer_params(seed=8), sum(SEQ_LENS)
    xBC, dt = torch.randn(num_tokens, CONV_DIM), torch.randn(num_tokens, NUM_HEADS)
    slots = _ints([4, -1, 2, 0])  # -1: no cache for sequence 1
    meta = (_query_start_loc(SEQ_LENS), slots, torch.tensor([True, True, False, True]))
    ref_states, states = _fresh_states(seed=9), _fresh_states(seed=9)
    conv_ref = causal_conv1d_ref(xBC, p["conv_weight"], None, ref_states[0], *meta)
    conv_out = torch.full_like(xBC, float("nan"))
    causal_conv1d_varlen(xBC, p["conv_weight"], None, states[0], *meta, out=conv_out)
    torch.testing.assert_close(conv_out, conv_ref, atol=ATOL, rtol=RTOL)
    x, B, C = _split_xBC(conv_ref)
    y_ref = ssm_scan_ref(x, dt, p["A"], B, C, None, None, ref_states[1], *meta)
    y = torch.full_like(y_ref, float("nan"))
    mamba_chunk_scan_varlen(x, dt, p["A"], B, C, None, None, states[1], *meta,
                            chunk_size=CHUNK_SIZE, out=y)  # fmt: skip
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=RTOL)
    for ref_state, state in zip(ref_states, states):
        torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_scan_applies_dt_limit():
    torch.manual_seed(2)
    p, num_tokens = _mixer_params(seed=10), 21
    x, dt = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM), torch.randn(num_tokens, NUM_HEADS) * 3
    B, C = torch.randn(2, num_tokens, NUM_GROUPS, D_STATE).unbind(0)
    meta = (_query_start_loc([num_tokens]), _ints([5]), torch.tensor([False]))
    ref_state, state = _fresh_states(seed=11)[1], _fresh_states(seed=11)[1]
    args = (x, dt, p["A"], B, C, p["D"], p["dt_bias"])
    y_ref = ssm_scan_ref(*args, ref_state, *meta, dt_limit=(0.05, 0.5))
    y = mamba_chunk_scan_varlen(*args, state, *meta, dt_limit=(0.05, 0.5), chunk_size=CHUNK_SIZE)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_chunked_prefill_split_equals_unsplit():
    torch.manual_seed(3)
    p, seq_lens, slots = _mixer_params(seed=12), [19, 2, 37], _ints([4, 1, 2])
    first_lens = [7, 1, 21]  # split points not aligned with CHUNK_SIZE or d_conv
    xBC, dt = torch.randn(sum(seq_lens), CONV_DIM), torch.randn(sum(seq_lens), NUM_HEADS)
    full_states = _fresh_states(seed=13)
    no_state = torch.tensor([False] * 3)
    y_full = _mixer_core("triton", xBC, dt, p, *full_states, _query_start_loc(seq_lens), slots,
                         no_state)  # fmt: skip

    starts = _query_start_loc(seq_lens)[:-1].tolist()
    first = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, first_lens)])
    second = torch.cat(
        [torch.arange(s + n, s + L) for s, n, L in zip(starts, first_lens, seq_lens)]
    )
    split_states = _fresh_states(seed=14)
    second_lens = [L - n for L, n in zip(seq_lens, first_lens)]
    y_first = _mixer_core("triton", xBC[first], dt[first], p, *split_states,
                          _query_start_loc(first_lens), slots, no_state)  # fmt: skip
    y_second = _mixer_core("triton", xBC[second], dt[second], p, *split_states,
                           _query_start_loc(second_lens), slots, ~no_state)  # fmt: skip
    torch.testing.assert_close(y_first, y_full[first], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(y_second, y_full[second], atol=ATOL, rtol=RTOL)
    for split_state, full_state in zip(split_states, full_states):
        torch.testing.assert_close(
            split_state[[4, 1, 2]], full_state[[4, 1, 2]], atol=ATOL, rtol=RTOL
        )


# ---------------------------------------------------------------- Triton decode


def _decode_step(xBC_t, dt_t, p, conv_state, ssm_state, slots):
    """One token per row: conv update -> split -> selective state update, outputs NaN-poisoned."""
    conv_out = torch.full_like(xBC_t, float("nan"))
    causal_conv1d_update(xBC_t, conv_state, p["conv_weight"], p["conv_bias"], slots, out=conv_out)
    x, B, C = _split_xBC(conv_out)
    y = torch.full_like(x, float("nan"))
    selective_state_update(ssm_state, x, dt_t, p["A"], B, C, p["D"], p["dt_bias"], slots, out=y)
    return y


@torch.no_grad()
def test_decode_steps_equal_prefill_of_same_tokens():
    torch.manual_seed(4)
    p, seq_lens, slots = _mixer_params(seed=15), [9, 6], _ints([3, 5])
    prompt_lens = [5, 1]  # then decode 4 and 5 more tokens; the shorter row pads with slot 0
    xBC, dt = torch.randn(sum(seq_lens), CONV_DIM), torch.randn(sum(seq_lens), NUM_HEADS)
    ref_states, states = _fresh_states(seed=16), _fresh_states(seed=16)
    y_ref = _mixer_core("ref", xBC, dt, p, *ref_states, _query_start_loc(seq_lens), slots,
                        torch.tensor([True, False]))  # fmt: skip

    starts = _query_start_loc(seq_lens)[:-1].tolist()
    prompt = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, prompt_lens)])
    prompt_meta = (_query_start_loc(prompt_lens), slots, torch.tensor([True, False]))
    y_prompt = _mixer_core("triton", xBC[prompt], dt[prompt], p, *states, *prompt_meta)
    torch.testing.assert_close(y_prompt, y_ref[prompt], atol=ATOL, rtol=RTOL)
    for step in range(max(L - n for L, n in zip(seq_lens, prompt_lens))):
        positions = [s + n + step for s, n in zip(starts, prompt_lens)]
        live = [n + step < L for n, L in zip(prompt_lens, seq_lens)]
        rows = torch.tensor([pos if ok else 0 for pos, ok in zip(positions, live)])
        step_slots = _ints([int(s) if ok else 0 for s, ok in zip(slots, live)])
        y = _decode_step(xBC[rows], dt[rows], p, *states, step_slots)
        assert not y.isnan().any(), "every row, padded or not, must be written"
        for row, ok in enumerate(live):
            if ok:
                torch.testing.assert_close(y[row], y_ref[rows[row]], atol=ATOL, rtol=RTOL)
    for ref_state, state in zip(ref_states, states):
        torch.testing.assert_close(state[[3, 5]], ref_state[[3, 5]], atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_padded_decode_rows_leave_other_slots_untouched():
    torch.manual_seed(5)
    p = _mixer_params(seed=17)
    slots = _ints([2, 0, 4, 0, -1])  # rows 1 and 3 share null slot 0; row 4 has no cache at all
    xBC_t, dt_t = torch.randn(5, CONV_DIM), torch.randn(5, NUM_HEADS)
    states, before = _fresh_states(seed=18), _fresh_states(seed=18)
    y = _decode_step(xBC_t, dt_t, p, *states, slots)
    assert not y.isnan().any()

    ref_states = _fresh_states(seed=18)
    real = [0, 2]
    meta = (_query_start_loc([1, 1]), slots[real], torch.tensor([True, True]))
    y_ref = _mixer_core("ref", xBC_t[real], dt_t[real], p, *ref_states, *meta)
    torch.testing.assert_close(y[real], y_ref, atol=ATOL, rtol=RTOL)
    for state, ref_state, old in zip(states, ref_states, before):
        torch.testing.assert_close(state[[2, 4]], ref_state[[2, 4]], atol=ATOL, rtol=RTOL)
        assert torch.equal(state[[1, 3, 5]], old[[1, 3, 5]]), "slots of no row must not change"


@torch.no_grad()
def test_decode_without_cache_matches_fresh_prefill():
    """A negative slot reads zeros: its output equals a one-token prefill with no initial state."""
    torch.manual_seed(6)
    p = _mixer_params(seed=19)
    xBC_t, dt_t = torch.randn(1, CONV_DIM), torch.randn(1, NUM_HEADS)
    states = _fresh_states(seed=20)
    y = _decode_step(xBC_t, dt_t, p, *states, _ints([-1]))
    meta = (_query_start_loc([1]), _ints([1]), torch.tensor([False]))
    y_ref = _mixer_core("ref", xBC_t, dt_t, p, *_fresh_states(seed=20), *meta)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=RTOL)
    assert all(torch.equal(s, f) for s, f in zip(states, _fresh_states(seed=20)))
