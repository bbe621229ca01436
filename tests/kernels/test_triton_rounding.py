"""The Triton rounding helpers round to nearest even exactly as torch's casts do.

Proves that ``round_to`` (bfloat16, float16) and ``round_to_e4m3`` give torch's ``.to(dtype)``
and ``clamp(+-448).to(float8_e4m3fn)`` bit for bit on values that exercise every case: ties
between two representable values (even and odd below), e4m3 subnormals, saturation past 448,
signed zeros, and random values over twelve orders of magnitude. On CPU this checks the
arithmetic rounding the interpreter needs; on a GPU the hardware conversions the kernels use.

Run: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_triton_rounding.py
    -p no:cacheprovider
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel below is decorated

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE, KERNEL_FP8_MAX  # noqa: E402
from pieceworks.kernels.triton_rounding import round_to, round_to_e4m3  # noqa: E402
from tests.kernels.test_triton_gemv import DEVICE, requires_triton  # noqa: E402

BLOCK = 1024


@triton.jit
def _round_kernel(y_ptr, bf16_ptr, fp16_ptr, e4m3_ptr, n, fp8_max, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0)
    tl.store(bf16_ptr + offsets, round_to(y, tl.bfloat16), mask=mask)
    tl.store(fp16_ptr + offsets, round_to(y, tl.float16), mask=mask)
    tl.store(e4m3_ptr + offsets, round_to_e4m3(y, fp8_max), mask=mask)


def cases() -> torch.Tensor:
    """Float32 values: ties and near-ties of bfloat16 and e4m3, subnormals, saturation, zeros,
    and random values from 1e-6 to 1e6 in magnitude."""
    generator = torch.Generator().manual_seed(0)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(KERNEL_FP8_DTYPE).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    e4m3_ties = (e4m3[1:] + e4m3[:-1]) / 2  # exactly halfway between neighbours
    bf16 = torch.randn(2048, generator=generator).bfloat16().float()
    bf16_ulp = torch.exp2(torch.floor(torch.log2(bf16.abs())) - 7)  # 8 significant bits
    bf16_ties = torch.cat([bf16 + bf16_ulp / 2, bf16 - bf16_ulp / 2])  # exactly halfway
    nudged = torch.cat([e4m3_ties * (1 + 2**-20), e4m3_ties * (1 - 2**-20)])
    magnitudes = 10 ** (torch.rand(4096, generator=generator) * 12 - 6)
    signs = torch.where(torch.rand(4096, generator=generator) < 0.5, -1.0, 1.0)
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 465.0, -500.0, 1e30, 2**-10, 2**-9])
    return torch.cat([e4m3, e4m3_ties, nudged, bf16_ties, magnitudes * signs, special])


@requires_triton
# the interpreter's float16 cast of 1e30 warns on its way to inf, which is torch's value too
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_rounding_equals_torch_casts():
    y = cases().to(DEVICE)
    bf16, fp16, e4m3 = (torch.empty_like(y) for _ in range(3))
    _round_kernel[(triton.cdiv(y.numel(), BLOCK),)](
        y, bf16, fp16, e4m3, y.numel(), KERNEL_FP8_MAX, BLOCK=BLOCK
    )
    expected_e4m3 = y.clamp(-KERNEL_FP8_MAX, KERNEL_FP8_MAX).to(KERNEL_FP8_DTYPE).float()
    for actual, expected in ((bf16, y.bfloat16().float()), (fp16, y.half().float()),
                             (e4m3, expected_e4m3)):  # fmt: skip
        mismatch = actual.view(torch.int32) != expected.view(torch.int32)
        assert not mismatch.any(), (y[mismatch][:8], actual[mismatch][:8], expected[mismatch][:8])
