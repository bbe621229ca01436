"""Which gated delta-rule implementation a layer gets, and fla's decode kernel under Triton's
interpreter against the torch form.

Proves: on the CPU both ops (``chunk_gated_delta_rule``, ``recurrent_gated_delta_rule``) run
their torch forms and say why fla's were passed over; on a fake H200 and a fake MI300 with the
``fla`` packages installed, fla's kernels are chosen for float16, bfloat16 and float32 and are on
the warm-up list, while float64, a key head above 256 or ``custom_ops`` ``-op`` give the torch
form with the reason; without the packages the reason says to install the ``fla`` extra; a Gated
DeltaNet layer takes the chosen functions. Where fla is installed, its fused recurrent kernel over
state slots (decode rows of one and of two tokens, padded rows on the null slot) equals the torch
form in outputs and written states under ``TRITON_INTERPRET=1``. fla's chunked kernels do not run
under the interpreter (their autotuner benchmarks through a GPU driver, and past that one of
them fails in the interpreter); the GPU tests compare them (``test_gated_delta_rule_fla_gpu.py``).
Run: PIECEWORKS_PLATFORM=cpu pytest tests/kernels/test_gated_delta_rule_fla.py -q
"""

from __future__ import annotations

import importlib.util
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fla's kernels are decorated

from pieceworks.core.config import CompilationConfig  # noqa: E402
from pieceworks.kernels import implementation  # noqa: E402
from pieceworks.kernels.chooser import KernelChooser  # noqa: E402
from pieceworks.kernels.gated_delta_rule import fla_gated_delta_rule, torch_state_slots  # noqa: E402
from pieceworks.kernels.gated_delta_rule.registration import CHUNK_OP, RECURRENT_OP  # noqa: E402
from pieceworks.models.gated_delta_net.mixer import GatedDeltaNet  # noqa: E402
from pieceworks.platforms.capability import amd_capability, nvidia_capability  # noqa: E402

H200 = nvidia_capability(9, 0, num_compute_units=132, shared_memory_per_block=232448)
MI300 = amd_capability("gfx942:sramecc+:xnack-", num_compute_units=304)
OPS = (CHUNK_OP, RECURRENT_OP)
FLA_NAMES = {CHUNK_OP: "fla_chunk", RECURRENT_OP: "fla_fused_recurrent"}
HAS_FLA = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("einops")


@pytest.fixture
def fla_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice as on a machine with the ``fla`` extra, whatever this one has."""
    monkeypatch.setattr(implementation, "package_installed", lambda name: True)


def test_cpu_runs_the_torch_forms_and_says_why(monkeypatch, fresh_platform):
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cpu")
    cpu = KernelChooser.for_current_platform()
    for op in OPS:
        choice = cpu.choose(op, dtype=torch.float32, head_size=128)
        assert choice.impl.native and choice.impl.fn is not None
        assert dict(choice.passed_over)[FLA_NAMES[op]] == "for amd/nvidia devices, not cpu"


@pytest.mark.parametrize("capability", [H200, MI300], ids=["h200", "mi300"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_and_rocm_get_fla_and_warm_it_up(fla_installed, capability, dtype):
    chooser = KernelChooser("cuda" if capability is H200 else "rocm", capability)
    for op in OPS:
        choice = chooser.choose(op, dtype=dtype, head_size=128)
        assert choice.impl.name == FLA_NAMES[op]
        assert choice.impl.fn.__module__ == fla_gated_delta_rule.__name__
    assert {choice.op for choice in chooser.warmup_kernels()} == set(OPS)


def test_what_fla_does_not_take_gets_the_torch_form_with_the_reason(fla_installed):
    h200 = KernelChooser("cuda", H200)
    cases = [
        ({"dtype": torch.float64, "head_size": 128}, "does not take float64"),
        ({"dtype": torch.bfloat16, "head_size": 512}, "takes head sizes up to 256, not 512"),
    ]
    for kwargs, reason in cases:
        choice = h200.choose(CHUNK_OP, **kwargs)
        assert choice.impl.name == "torch"
        assert (FLA_NAMES[CHUNK_OP], reason) in choice.passed_over
    off = KernelChooser("cuda", H200, CompilationConfig(custom_ops=[f"-{RECURRENT_OP}"]))
    assert off.choose(RECURRENT_OP).impl.name == "torch"
    assert off.choose(CHUNK_OP).impl.name == "fla_chunk"


def test_without_fla_the_reason_says_to_install_the_extra(monkeypatch):
    monkeypatch.setattr(implementation, "package_installed", lambda name: name != "fla")
    choice = KernelChooser("cuda", H200).choose(RECURRENT_OP, dtype=torch.bfloat16)
    assert choice.impl.name == "torch"
    assert dict(choice.passed_over)["fla_fused_recurrent"] == (
        "needs the package(s) fla, not installed (pip install 'pieceworks[fla]')"
    )


def test_a_gated_delta_net_layer_takes_the_chosen_functions(fla_installed):
    """``choose_kernels`` asks for the layer's dtype and key head size (a stand-in layer: the
    hook reads only those)."""
    layer = types.SimpleNamespace(
        norm=types.SimpleNamespace(weight=torch.ones(8, dtype=torch.bfloat16)), head_k_dim=128
    )
    GatedDeltaNet.choose_kernels(layer, KernelChooser("cuda", H200))
    assert layer.chunk_kernel is fla_gated_delta_rule.chunk_gated_delta_rule_varlen
    assert layer.recurrent_kernel is fla_gated_delta_rule.recurrent_gated_delta_rule_slots
    GatedDeltaNet.choose_kernels(
        layer, KernelChooser("cuda", H200, CompilationConfig(custom_ops=["none"]))
    )
    assert layer.chunk_kernel is torch_state_slots.chunk_gated_delta_rule_varlen
    assert layer.recurrent_kernel is torch_state_slots.recurrent_gated_delta_rule_slots


@pytest.mark.skipif(not HAS_FLA, reason="fla-core and einops are not installed (the fla extra)")
@pytest.mark.parametrize("num_tokens", [1, 2])
def test_fla_fused_recurrent_over_slots_equals_the_torch_form(num_tokens):
    """Three decode rows (slots 3, 1 and the null slot 0 of a padded row), Hv = 2 Hk, float32."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator().manual_seed(num_tokens)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(device)  # noqa: E731
    rows, k_heads, v_heads, k_dim, v_dim = 3, 2, 4, 16, 16
    q, k = randn(rows, num_tokens, k_heads, k_dim), randn(rows, num_tokens, k_heads, k_dim)
    v = randn(rows, num_tokens, v_heads, v_dim)
    g = -torch.nn.functional.softplus(randn(rows, num_tokens, v_heads))
    beta = torch.sigmoid(randn(rows, num_tokens, v_heads))
    slots = torch.tensor([3, 1, 0], dtype=torch.int32, device=device)
    state = randn(5, v_heads, k_dim, v_dim)
    original, expected_state = state.clone(), state.clone()
    expected = torch_state_slots.recurrent_gated_delta_rule_slots(
        q, k, v, g, beta, expected_state, slots
    )
    out = fla_gated_delta_rule.recurrent_gated_delta_rule_slots(q, k, v, g, beta, state, slots)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)
    untouched = [2, 4]  # no row's slot
    assert torch.equal(state[untouched], original[untouched])
