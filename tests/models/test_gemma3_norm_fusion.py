"""Gemma 3's sandwich norms compile to one kernel between two GEMVs.

Between ``o_proj`` and the gate/up GEMV a Gemma 3 layer runs ``post_attention_layernorm``, the
residual add and ``pre_feedforward_layernorm`` (between ``down_proj`` and the next layer's qkv
GEMV: ``post_feedforward_layernorm``, the add and the next ``input_layernorm``). ``GemmaRMSNorm``
is always its torch form (plain ATen, never an opaque op), so in the piece Inductor compiles the
two norms and the add are one fusable chain. This pins that Inductor makes them one kernel on
CUDA at Gemma-3-4B's hidden size (2560, bfloat16, 1 and 16 tokens), its result within bfloat16's
tolerance of the eager layers' (``gpu``: the CPU's C++ kernels are not what decode runs; there
the same chain is one kernel too, an Inductor compile of several seconds that the CPU suite does
without).
Run: python -m pytest tests/models/test_gemma3_norm_fusion.py
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from pieceworks.models.layers.layernorm import GemmaRMSNorm


def compiled_kernels(hidden: int, num_tokens: int, dtype: torch.dtype, device: str):
    """The kernels Inductor generates for ``pre(post(o), residual)`` and whether its result
    is within the dtype's tolerance of the eager layers'."""
    post, pre = GemmaRMSNorm(hidden, 1e-6), GemmaRMSNorm(hidden, 1e-6)
    for norm in (post, pre):
        torch.nn.init.normal_(norm.weight, 0.0, 0.3)
        norm.to(device)

    def sandwich(o: torch.Tensor, residual: torch.Tensor):
        return pre(post(o), residual)

    generator = torch.Generator().manual_seed(0)
    o, residual = (torch.randn(num_tokens, hidden, generator=generator).to(device, dtype)
                   for _ in range(2))  # fmt: skip
    compiled = torch.compile(sandwich, backend="inductor", fullgraph=True, dynamic=False)
    (normed, summed), codes = run_and_get_code(compiled, o, residual)
    expected_normed, expected_summed = sandwich(o, residual)
    # Eager rounds post's output to the dtype before the add; the fused kernel keeps it in
    # float32 (Inductor does not emulate the intermediate rounding), one ulp apart at most.
    torch.testing.assert_close(summed, expected_summed)
    torch.testing.assert_close(normed, expected_normed)
    return re.findall(r"^(\w+) = async_compile\.\w+\(", "\n".join(codes), flags=re.MULTILINE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_post_norm_add_and_pre_norm_are_one_kernel_at_gemma3_4b_size(num_tokens):
    kernels = compiled_kernels(2560, num_tokens, torch.bfloat16, "cuda")
    assert len(kernels) == 1, kernels
