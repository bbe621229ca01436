"""The kernel chooser picks one implementation per op from what each supports, and says why.

On a fake H200 capability the decode GEMVs (and the Hopper resident GEMV for FP8) are chosen; on
a fake ROCm (MI300) capability no NVIDIA-only implementation is ever chosen, FP8 is e4m3fnuz, so
``fp8_linear`` gets ``torch._scaled_mm`` (the FP8 kernels store e4m3fn), and every chosen jitted
kernel is on the warm-up list; on the CPU every op runs its torch form.
``custom_ops`` switches kernels off and on as in vLLM, and a platform's own registration is
chosen there and nowhere else. Choices belong to the chooser that made them: two engines in one
process with different ``custom_ops`` each run, and report, their own.
Run: PYTHONPATH=. PIECEWORKS_PLATFORM=cpu python -m pytest tests/kernels/test_chooser.py -q
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.core.config import CompilationConfig
from pieceworks.kernels.chooser import KernelChooser
from pieceworks.kernels.implementation import Supports
from pieceworks.kernels.registry import known_ops, register_kernel, unregister_kernel
from pieceworks.platforms.capability import amd_capability, nvidia_capability

H200 = nvidia_capability(9, 0, num_compute_units=132, shared_memory_per_block=232448)
MI300 = amd_capability("gfx942:sramecc+:xnack-", num_compute_units=304)


def test_hopper_gets_the_gemvs_and_the_resident_fp8_gemv():
    h200 = KernelChooser("cuda", H200)

    def on_h200(op: str) -> str:
        return h200.choose(op).impl.name

    assert on_h200("linear") == "triton_gemv"
    assert on_h200("fp8_linear") == "hopper_resident_gemv"
    assert on_h200("silu_and_mul") == "triton_silu_and_mul"
    assert on_h200("rotary") == "triton_gemv_rope"
    assert on_h200("argmax") == "triton_argmax"
    float64 = h200.choose("linear", dtype=torch.float64)
    assert float64.impl.name == "torch"
    assert ("triton_gemv", "does not take float64") in float64.passed_over


def test_rocm_never_gets_nvidia_only_code_and_warms_up_every_triton_kernel():
    """Every op on a fake MI300: no implementation whose vendors exclude AMD, the FP8 format the
    MI300 family converts, and the warm-up list holds each chosen jitted kernel."""
    platform = type("FakeRocm", (), {"name": "rocm", "device_capability": lambda self: MI300})()
    mi300 = KernelChooser.for_platform(platform)
    fp8 = MI300.fp8_dtype
    choices = {
        op: mi300.choose(op, dtype=fp8 if op == "fp8_linear" else None) for op in known_ops()
    }
    for op, choice in choices.items():
        vendors = choice.impl.supports.vendors
        assert vendors is None or "amd" in vendors, f"{op} got {choice.impl.name}"
    assert MI300.fp8_dtype == torch.float8_e4m3fnuz
    assert choices["fp8_linear"].impl.name == "scaled_mm"  # the FP8 kernels store e4m3fn
    passed = dict(choices["fp8_linear"].passed_over)
    assert passed["hopper_resident_gemv"] == "for nvidia devices, not amd"
    assert passed["triton_gemv"] == "does not take float8_e4m3fnuz"
    warmed = {choice.op for choice in mi300.warmup_kernels()}
    assert warmed == {op for op, choice in choices.items() if choice.impl.jitted}
    assert {"linear", "silu_and_mul", "rotary", "argmax"} <= warmed


@pytest.fixture
def on_the_cpu(monkeypatch: pytest.MonkeyPatch, fresh_platform) -> None:
    """The CPU platform is the current one, whatever this machine has (a GPU machine runs these
    tests too)."""
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cpu")


def test_cpu_runs_every_op_in_torch_and_says_why(on_the_cpu):
    cpu = KernelChooser.for_current_platform()
    for op in known_ops():
        choice = cpu.choose(op)
        assert choice.impl.native, choice.describe()
    assert "triton_gemv: needs triton" in cpu.choose("linear").describe()


def test_custom_ops_switch_kernels_off_and_on_as_in_vllm():
    def h200_with(custom_ops: list[str]) -> KernelChooser:
        return KernelChooser("cuda", H200, CompilationConfig(custom_ops=custom_ops))

    def linear_with(custom_ops: list[str]) -> str:
        return h200_with(custom_ops).choose("linear").impl.name

    assert linear_with([]) == "triton_gemv"
    assert linear_with(["all"]) == "triton_gemv"
    assert linear_with(["-linear"]) == "torch"
    assert linear_with(["none"]) == "torch"
    assert linear_with(["none", "+linear"]) == "triton_gemv"
    passed = dict(h200_with(["-linear"]).choose("linear").passed_over)
    assert passed["triton_gemv"] == "switched off (custom_ops)"


def test_custom_ops_naming_an_unknown_op_is_a_clear_error():
    with pytest.raises(ValueError) as error:
        KernelChooser("cuda", H200, CompilationConfig(custom_ops=["+linear", "-silu_and_mull"]))
    message = str(error.value)
    assert message.startswith("custom_ops names unknown op(s) ['silu_and_mull']; known ops: ")
    assert "silu_and_mul" in message and "'+op', '-op'" in message


def test_a_platform_s_own_kernel_is_chosen_there_and_nowhere_else():
    def vendor_norm(x, weight, eps):
        return x

    register_kernel("rms_norm", vendor_norm, name="vendor_norm", platform="vendor")
    try:
        there = KernelChooser("vendor", H200).choose("rms_norm")
        elsewhere = KernelChooser("cuda", H200).choose("rms_norm")
        assert there.impl.fn is vendor_norm
        assert elsewhere.impl.name == "torch"
        assert ("vendor_norm", "only for platform 'vendor'") in elsewhere.passed_over
    finally:
        unregister_kernel("rms_norm", "vendor_norm")


def test_an_op_nothing_supports_is_a_clear_error():
    register_kernel(
        "warp_drive", None, name="nvidia_only", supports=Supports(vendors=frozenset({"nvidia"}))
    )
    try:
        with pytest.raises(ValueError, match="no implementation of kernel op 'warp_drive'"):
            KernelChooser("rocm", MI300).choose("warp_drive")
    finally:
        unregister_kernel("warp_drive", "nvidia_only")


def test_platforms_kernels_prints_each_op_s_choice_and_why(on_the_cpu, capsys):
    from pieceworks.entrypoints.cli import main

    assert main(["platforms", "--kernels"]) == 0
    printed = capsys.readouterr().out
    assert "kernels on cpu" in printed
    # the reason Triton was passed over is said once, as it is (installed or not)
    assert "linear: torch (passed over: triton_gemv: no compiled Triton (*))" in printed
    assert printed.count("(*) Triton is") == 1
    assert "attention: TorchAttentionBackend" in printed


def test_choices_belong_to_the_chooser_that_made_them():
    """Two choosers in one process (two engines' worth) keep apart what each chose and warms."""
    on = KernelChooser("cuda", H200)
    off = KernelChooser("cuda", H200, CompilationConfig(custom_ops=["none"]))
    assert on.choose("linear").impl.name == "triton_gemv"
    assert off.choose("linear").impl.name == "torch"
    assert on.chosen_kernels()["linear"].impl.name == "triton_gemv"  # not overwritten by off
    assert [choice.op for choice in on.warmup_kernels()] == ["linear"]
    assert off.warmup_kernels() == []
    assert "linear: triton_gemv" in on.describe() and "linear: torch" in off.describe()


# Building an engine registers pieceworks' ops for the current platform's dispatch key, once per
# process: under the forced CPU platform on a GPU machine, the later GPU tests of the process
# would find the attention op without a CUDA kernel.
@pytest.mark.skipif(torch.cuda.is_available(), reason="builds CPU engines: CPU machines only")
def test_two_llms_with_different_custom_ops_each_get_their_own_kernels(on_the_cpu):
    """Two engines in one process: a platform kernel for ``rms_norm`` registered on the CPU, one
    engine with default ``custom_ops`` runs it in every RMSNorm, the other (``-rms_norm``) the
    torch form; each engine's chooser reports its own, whichever was built last."""
    from pieceworks.engine.llm import LLM
    from pieceworks.models.layers.layernorm import RMSNorm

    def cpu_norm(x, weight, eps):
        return x

    register_kernel("rms_norm", cpu_norm, name="cpu_norm", platform="cpu")
    try:
        engines = {
            name: LLM(
                "llama-tiny",
                compilation_config={"level": 0, "custom_ops": custom_ops},
                dtype="float32",
                max_num_seqs=2,
            )  # fmt: skip
            for name, custom_ops in (("on", []), ("off", ["-rms_norm"]))
        }
    finally:
        unregister_kernel("rms_norm", "cpu_norm")
    for name, expected, kernel in (("on", "cpu_norm", cpu_norm), ("off", "torch", None)):
        runner = engines[name].engine.runner
        assert runner.kernels.chosen_kernels()["rms_norm"].impl.name == expected
        norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
        assert norms and all(norm.kernel is kernel for norm in norms)
        assert f"rms_norm: {expected}" in runner.kernels.describe()
