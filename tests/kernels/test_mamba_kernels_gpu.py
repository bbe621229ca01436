"""Mamba2 kernels on a real GPU: Triton matches the float32 references at Bamba-9B shapes with
bf16 activations and a float32 SSM state, and a decode step replays correctly from a CUDA graph.

Proves that `causal_conv1d_varlen` and `mamba_chunk_scan_varlen` equal the references on packed
prefills of up to 2048 tokens (ragged, mixed initial states, a padded zero-length sequence); that
`causal_conv1d_update` + `selective_state_update` equal them for decode batches of 1 to 8 over
several steps; and that a decode step captured once into a CUDA graph gives the right answer when
replayed after the runner rewrites inputs and state indices (padding included) in place.

Run (GPU machine): PYTHONPATH=. python -m pytest tests/kernels/test_mamba_kernels_gpu.py -q
"""

import math

import pytest
import torch

from pieceworks.models.mamba.ops import (
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_varlen,
    mamba_chunk_scan_varlen,
    selective_state_update,
    ssm_scan_ref,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
NUM_HEADS, HEAD_DIM, NUM_GROUPS, D_STATE, D_CONV = 128, 64, 1, 128, 4  # Bamba-9B
INTERMEDIATE = NUM_HEADS * HEAD_DIM
CONV_DIM = INTERMEDIATE + 2 * NUM_GROUPS * D_STATE  # 8192 + 256
NUM_SLOTS = 10
REL_TOL = 2e-2  # bf16 dot operands inside the kernels vs a float32 reference


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = REL_TOL):
    """Max abs error within ``rel`` of the largest reference magnitude (bf16-scale agreement)."""
    error = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert error <= rel * scale, f"max error {error:.3e} > {rel} * {scale:.3e}"


def make_params() -> dict[str, torch.Tensor]:
    """Parameters initialised as Mamba2 does: A in [-16, -1], dt in [1e-3, 1e-1] after softplus."""
    dt = torch.exp(torch.rand(NUM_HEADS, device=DEVICE) * math.log(100) + math.log(1e-3))
    return {
        "conv_weight": (torch.randn(CONV_DIM, D_CONV, device=DEVICE) * 0.3).to(DTYPE),
        "conv_bias": (torch.randn(CONV_DIM, device=DEVICE) * 0.1).to(DTYPE),
        "A": -torch.empty(NUM_HEADS, device=DEVICE).uniform_(1, 16),
        "D": torch.randn(NUM_HEADS, device=DEVICE),
        "dt_bias": dt + torch.log(-torch.expm1(-dt)),  # inverse softplus
    }


def make_states() -> tuple[torch.Tensor, torch.Tensor]:
    """(conv_state bf16, ssm_state float32) caches with random contents."""
    conv_state = torch.randn(NUM_SLOTS, CONV_DIM, D_CONV - 1, device=DEVICE).to(DTYPE)
    ssm_state = torch.randn(NUM_SLOTS, NUM_HEADS, HEAD_DIM, D_STATE, device=DEVICE) * 0.5
    return conv_state, ssm_state


def split_xBC(xBC: torch.Tensor):
    """(T, conv_dim) -> strided views x (T, H, P), B (T, G, N), C (T, G, N)."""
    x, B, C = xBC.split([INTERMEDIATE, NUM_GROUPS * D_STATE, NUM_GROUPS * D_STATE], dim=-1)
    num_tokens = xBC.shape[0]
    return (
        x.view(num_tokens, NUM_HEADS, HEAD_DIM),
        B.view(num_tokens, NUM_GROUPS, D_STATE),
        C.view(num_tokens, NUM_GROUPS, D_STATE),
    )


def batch_meta(seq_lens: list[int], slots: list[int], has_initial: list[bool]):
    query_start_loc = torch.tensor([0, *seq_lens], device=DEVICE).cumsum(0).int()
    state_indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    return query_start_loc, state_indices, torch.tensor(has_initial, device=DEVICE)


def clone_states(states):
    return tuple(state.clone() for state in states)


@pytest.mark.parametrize(
    "seq_lens, slots, has_initial",
    [
        ([2048], [3], [False]),
        ([1000, 3, 517, 0, 64], [1, 7, 2, 0, 5], [True, False, True, False, True]),
    ],
)
@torch.no_grad()
def test_prefill_matches_reference(seq_lens, slots, has_initial):
    params, num_tokens = make_params(), sum(seq_lens)
    xBC = torch.randn(num_tokens, CONV_DIM, device=DEVICE, dtype=DTYPE)
    dt = torch.randn(num_tokens, NUM_HEADS, device=DEVICE, dtype=DTYPE)
    meta = batch_meta(seq_lens, slots, has_initial)
    states = make_states()
    ref_states = clone_states(states)
    weights = (params["conv_weight"], params["conv_bias"])

    conv_ref = causal_conv1d_ref(xBC, *weights, ref_states[0], *meta)
    conv_out = causal_conv1d_varlen(xBC, *weights, states[0], *meta)
    assert_close_rel(conv_out, conv_ref)
    assert torch.equal(states[0], ref_states[0])  # the cache is a copy of inputs: exact

    x, B, C = split_xBC(conv_ref)  # the same scan inputs for both, to isolate the scan
    scan_args = (x, dt, params["A"], B, C, params["D"], params["dt_bias"])
    y_ref = ssm_scan_ref(*scan_args, ref_states[1], *meta)
    y = mamba_chunk_scan_varlen(*scan_args, states[1], *meta)
    assert_close_rel(y, y_ref)
    for slot, seq_len in zip(slots, seq_lens):
        assert_close_rel(states[1][slot], ref_states[1][slot])
        if seq_len == 0:
            assert torch.equal(states[1][slot], ref_states[1][slot])


def decode_step(xBC_t, dt_t, params, conv_state, ssm_state, state_indices, conv_out, y):
    """Conv update + state update for one token per row, written into the given buffers."""
    causal_conv1d_update(xBC_t, conv_state, params["conv_weight"], params["conv_bias"],
                         state_indices, out=conv_out)  # fmt: skip
    x, B, C = split_xBC(conv_out)
    selective_state_update(ssm_state, x, dt_t, params["A"], B, C, params["D"], params["dt_bias"],
                           state_indices, out=y)  # fmt: skip
    return y


def reference_step(xBC_t, dt_t, params, conv_state, ssm_state, state_indices):
    """The same step through the prefill references (length-1 sequences with initial state)."""
    num_seqs = xBC_t.shape[0]
    meta = batch_meta([1] * num_seqs, state_indices.tolist(), [True] * num_seqs)
    conv = causal_conv1d_ref(xBC_t, params["conv_weight"], params["conv_bias"], conv_state, *meta)
    x, B, C = split_xBC(conv)
    scan_args = (x, dt_t, params["A"], B, C, params["D"], params["dt_bias"])
    return ssm_scan_ref(*scan_args, ssm_state, *meta)


@pytest.mark.parametrize("num_seqs", [1, 3, 8])
@torch.no_grad()
def test_decode_steps_match_reference(num_seqs):
    params, states = make_params(), make_states()
    ref_states = clone_states(states)
    state_indices = torch.randperm(NUM_SLOTS, device=DEVICE)[:num_seqs].int()
    for _ in range(4):
        xBC_t = torch.randn(num_seqs, CONV_DIM, device=DEVICE, dtype=DTYPE)
        dt_t = torch.randn(num_seqs, NUM_HEADS, device=DEVICE, dtype=DTYPE)
        conv_out = torch.empty_like(xBC_t)
        y = torch.empty(num_seqs, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        decode_step(xBC_t, dt_t, params, *states, state_indices, conv_out, y)
        y_ref = reference_step(xBC_t, dt_t, params, *ref_states, state_indices)
        assert_close_rel(y, y_ref)
    assert torch.equal(states[0], ref_states[0])  # the conv cache holds copied inputs: exact
    assert_close_rel(states[1], ref_states[1], rel=1e-4)  # the update itself is all float32


@torch.no_grad()
def test_decode_step_replays_from_cuda_graph():
    max_seqs, null_slot = 8, 0
    params, states = make_params(), make_states()
    static = {
        "xBC_t": torch.zeros(max_seqs, CONV_DIM, device=DEVICE, dtype=DTYPE),
        "dt_t": torch.zeros(max_seqs, NUM_HEADS, device=DEVICE, dtype=DTYPE),
        "state_indices": torch.full((max_seqs,), null_slot, dtype=torch.int32, device=DEVICE),
        "conv_out": torch.empty(max_seqs, CONV_DIM, device=DEVICE, dtype=DTYPE),
        "y": torch.empty(max_seqs, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE),
    }

    def step():
        return decode_step(static["xBC_t"], static["dt_t"], params, *states,
                           static["state_indices"], static["conv_out"], static["y"])  # fmt: skip

    graph = _capture(step)
    for num_seqs in (8, 5):  # 5 real rows: the last 3 are padding pointing at the null slot
        slots = torch.randperm(NUM_SLOTS - 1, device=DEVICE)[:num_seqs].int() + 1
        xBC_t = torch.randn(num_seqs, CONV_DIM, device=DEVICE, dtype=DTYPE)
        dt_t = torch.randn(num_seqs, NUM_HEADS, device=DEVICE, dtype=DTYPE)
        ref_states = clone_states(states)
        y_ref = reference_step(xBC_t, dt_t, params, *ref_states, slots)
        static["xBC_t"][:num_seqs].copy_(xBC_t)
        static["dt_t"][:num_seqs].copy_(dt_t)
        static["state_indices"].fill_(null_slot)
        static["state_indices"][:num_seqs].copy_(slots)
        graph.replay()
        assert_close_rel(static["y"][:num_seqs], y_ref)
        touched = slots.long()
        assert_close_rel(states[1][touched], ref_states[1][touched], rel=1e-4)
        assert torch.equal(states[0][touched], ref_states[0][touched])


def _capture(step) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (compiles the Triton kernels), then capture one call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
