"""The Gated DeltaNet layer's causal conv through the kernel chooser: the Mamba2 Triton kernels
where Triton runs, the torch forms elsewhere, with the same results.

Proves: on the CPU both conv ops (``causal_conv1d_update``, ``causal_conv1d_varlen``) choose the
torch form and say why Triton's was passed over; on a fake H200 the Triton kernels are chosen
(and listed for warm-up) for float16, bfloat16 and float32, not float64, and ``custom_ops``
``-op`` switches one off; a layer takes the chosen functions, or its torch forms. Under
``TRITON_INTERPRET=1`` (no GPU) a mixed step through the Gated DeltaNet backend (decode rows, a
padded row on the null slot, a continued chunk and a new prompt) with the Triton conv kernels
equals the step with the torch forms, in outputs and in both written states (float32). The GPU
file runs the same step compiled (``test_gated_delta_net_conv_gpu.py``).
Run: PIECEWORKS_PLATFORM=cpu pytest tests/kernels/test_gated_delta_net_conv.py -q
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

from pieceworks.core.config import CompilationConfig  # noqa: E402
from pieceworks.kernels.chooser import KernelChooser  # noqa: E402
from pieceworks.kernels.mamba import registration  # noqa: E402
from pieceworks.models.attention.metadata import AttentionMetadata  # noqa: E402
from pieceworks.models.gated_delta_net.backend import (  # noqa: E402
    GatedDeltaNetBackend,
    GatedDeltaNetParams,
    conv_update_torch,
)
from pieceworks.models.gated_delta_net.mixer import GatedDeltaNet  # noqa: E402
from pieceworks.models.mamba.ops import causal_conv1d_ref  # noqa: E402
from pieceworks.platforms.capability import nvidia_capability  # noqa: E402

H200 = nvidia_capability(9, 0, num_compute_units=132, shared_memory_per_block=232448)
OPS = (registration.CONV_UPDATE_OP, registration.CONV_VARLEN_OP)
K_HEADS, V_HEADS, K_DIM, V_DIM, NUM_SLOTS, D_CONV = 2, 4, 16, 8, 8, 4


def test_cpu_runs_the_torch_forms_and_says_why(monkeypatch, fresh_platform):
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cpu")
    cpu = KernelChooser.for_current_platform()
    for op in OPS:
        choice = cpu.choose(op, dtype=torch.float32)
        assert choice.impl.native and choice.impl.fn is None  # the layer keeps its torch form
        assert dict(choice.passed_over)["triton"].startswith("needs triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_triton_device_gets_the_triton_kernels_and_warms_them_up(dtype):
    chooser = KernelChooser("cuda", H200)
    for op in OPS:
        assert chooser.choose(op, dtype=dtype).impl.name == "triton"
    assert set(OPS) <= {choice.op for choice in chooser.warmup_kernels()}
    assert chooser.choose(OPS[0], dtype=torch.float64).impl.name == "torch"
    off = KernelChooser("cuda", H200, CompilationConfig(custom_ops=[f"-{OPS[0]}"]))
    assert off.choose(OPS[0], dtype=dtype).impl.name == "torch"
    assert off.choose(OPS[1], dtype=dtype).impl.name == "triton"


def test_a_layer_takes_the_chosen_conv_or_its_torch_form():
    """A stand-in layer: the hook reads only the dtype and the key head size."""
    layer = types.SimpleNamespace(
        norm=types.SimpleNamespace(weight=torch.ones(8, dtype=torch.bfloat16)), head_k_dim=128
    )
    GatedDeltaNet.choose_kernels(layer, KernelChooser("cuda", H200))
    assert layer.conv_update_kernel is registration.triton_causal_conv1d_update
    assert layer.conv_varlen_kernel is registration.triton_causal_conv1d_varlen
    torch_only = CompilationConfig(custom_ops=["none"])
    GatedDeltaNet.choose_kernels(layer, KernelChooser("cuda", H200, torch_only))
    assert layer.conv_update_kernel is conv_update_torch
    assert layer.conv_varlen_kernel is causal_conv1d_ref


def mixed_step(device: torch.device, dtype: torch.dtype, conv_kernels: tuple) -> tuple:
    """Three decode rows (slots 1, 4 and the null slot 0 of a padded row), then a chunk of 5
    tokens continuing from slot 2 and a new prompt of 7 on slot 5: output and both states."""
    decode_slots, prefill_lengths = [1, 4, 0], [5, 7]
    num_decodes = len(decode_slots)
    num_tokens = num_decodes + sum(prefill_lengths)
    conv_dim = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
    generator = torch.Generator().manual_seed(2)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(device)  # noqa: E731
    mixed_qkv = randn(num_tokens, conv_dim).to(dtype)
    g = -F.softplus(randn(num_tokens, V_HEADS))
    beta = torch.sigmoid(randn(num_tokens, V_HEADS)).to(dtype)
    cache = (
        randn(NUM_SLOTS, conv_dim, D_CONV - 1).to(dtype),
        0.1 * randn(NUM_SLOTS, V_HEADS, K_DIM, V_DIM),
    )
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        max_query_len=max(prefill_lengths),
        query_start_loc=torch.tensor([0, 1, 2, 3, 8, 15], dtype=torch.int32, device=device),
        seq_lens=torch.ones(5, dtype=torch.int32, device=device),  # read: only its length
        block_tables=torch.zeros(5, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        state_indices=torch.tensor([*decode_slots, 2, 5], dtype=torch.int32, device=device),
        has_initial_state=torch.tensor([True, True, True, True, False], device=device),
        num_decodes=num_decodes,
    )
    weight = 0.3 * randn(conv_dim, D_CONV).to(dtype)
    update, varlen = conv_kernels
    params = GatedDeltaNetParams(
        weight, K_HEADS, V_HEADS, K_DIM, V_DIM,
        conv_update_kernel=update, conv_varlen_kernel=varlen,
    )  # fmt: skip
    output = torch.empty(num_tokens, V_HEADS * V_DIM, dtype=dtype, device=device)
    GatedDeltaNetBackend.forward(mixed_qkv, g, beta, output, cache, params, metadata)
    return output, *cache


TORCH_CONV = (conv_update_torch, causal_conv1d_ref)
TRITON_CONV = (registration.triton_causal_conv1d_update, registration.triton_causal_conv1d_varlen)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU file runs it compiled")
def test_a_mixed_step_with_the_triton_conv_equals_the_torch_forms():
    device = torch.device("cpu")
    expected = mixed_step(device, torch.float32, TORCH_CONV)
    actual = mixed_step(device, torch.float32, TRITON_CONV)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
