"""pieceworks' own kernel implementations, as the registry sees them (``registry.py``).

Each entry says what the kernel needs; the layers that launch them read the choice when the
model is built. Every op has a native entry (its torch form, which Inductor fuses), chosen where
no kernel is supported or ``custom_ops`` switches the kernel off. Names that say ``hopper`` are
NVIDIA-only code (Gluon ``wgmma`` kernels) and never run on another vendor.

Ops:
- ``linear``: the decode GEMV (``gemv/triton_gemv.py``) for at most 16 tokens (64 for a small
  weight, ``max_gemv_tokens``), else ``F.linear``;
- ``fp8_linear``: the resident-weight GEMV (``gemv/resident_gemv.py``, Hopper), the FP8 GEMV
  (both e4m3fn only: chosen for ``dtype=capability.fp8_dtype``, so not on MI300's e4m3fnuz),
  ``torch._scaled_mm`` where the device has native FP8 GEMMs, the dequantizing torch reference;
- ``rms_norm``: the torch form (the FP8 fusion pass makes it ``norm_quant/triton_norm_quant.py``);
- ``silu_and_mul``: the Triton epilogue kernel (``activation/triton_silu_and_mul.py``) behind the
  gated GEMV where it takes too many tokens for the GEMV, or the torch form;
- ``gelu_and_mul``: the GeGLU kernel (``activation/triton_gelu_and_mul.py``) or the torch form;
- ``rotary``: the qkv GEMV's rotary epilogue (``gemv/triton_gemv_rope.py``; after q/k head norms,
  the GEMV and the norm-and-rotate kernel, ``rope/triton_qk_norm_rope.py``) or the torch form;
- ``argmax``: the greedy row argmax (``sampling/triton_argmax.py``) or ``torch.argmax``;
- ``chunk_gated_delta_rule``, ``recurrent_gated_delta_rule``: flash-linear-attention's kernels
  or the torch forms, each with its ``fn`` (``gated_delta_rule/registration.py``);
- ``causal_conv1d_update``, ``causal_conv1d_varlen``: the Mamba2 Triton conv kernels for the
  Gated DeltaNet layer, or its torch forms (``mamba/registration.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE
from pieceworks.kernels.gated_delta_rule.registration import gated_delta_rule_kernels
from pieceworks.kernels.implementation import KernelImpl, Supports
from pieceworks.kernels.mamba.registration import causal_conv1d_kernels
from pieceworks.platforms.capability import FP8_GEMM, TRITON, WARPGROUP_MMA

GEMV_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


NVIDIA_HOPPER = Supports(vendors=frozenset({"nvidia"}), features=frozenset({TRITON, WARPGROUP_MMA}))
TRITON_ONLY = Supports(features=frozenset({TRITON}))
KERNEL_FP8 = frozenset({KERNEL_FP8_DTYPE})  # the FP8 kernels store tl.float8e4nv

# (op, name, priority, supports); every op also gets its native "torch" entry
BUILTIN_KERNELS: tuple[tuple[str, str, int, Supports], ...] = (
    ("linear", "triton_gemv", 10, Supports(features=frozenset({TRITON}), dtypes=GEMV_DTYPES)),
    (
        "fp8_linear",
        "hopper_resident_gemv",
        20,
        dataclasses.replace(NVIDIA_HOPPER, dtypes=KERNEL_FP8),
    ),
    ("fp8_linear", "triton_gemv", 10, dataclasses.replace(TRITON_ONLY, dtypes=KERNEL_FP8)),
    ("rms_norm", "torch", 0, Supports()),
    ("silu_and_mul", "triton_silu_and_mul", 10, TRITON_ONLY),
    ("gelu_and_mul", "triton_gelu_and_mul", 10, TRITON_ONLY),
    ("rotary", "triton_gemv_rope", 10, TRITON_ONLY),
    ("argmax", "triton_argmax", 10, TRITON_ONLY),
)


def builtin_kernels() -> list[KernelImpl]:
    """Every built-in implementation: the jitted kernels, ``torch._scaled_mm`` for FP8, each
    op's native torch form, and the gated delta rule's and the causal conv's families."""
    entries = [
        KernelImpl(op, name, supports, priority=priority, jitted=True)
        for op, name, priority, supports in BUILTIN_KERNELS
        if name != "torch"
    ]
    scaled_mm = Supports(features=frozenset({FP8_GEMM}))
    entries.append(KernelImpl("fp8_linear", "scaled_mm", scaled_mm, priority=5))
    for op in sorted({op for op, *_ in BUILTIN_KERNELS}):
        entries.append(KernelImpl(op, "torch", native=True))
    return entries + gated_delta_rule_kernels() + causal_conv1d_kernels()
