"""The Gated DeltaNet layer's conv with the Mamba2 Triton kernels, compiled on a GPU, equals its
torch forms.

Proves: the mixed step of ``test_gated_delta_net_conv.py`` (decode rows, a padded row on the
null slot, a continued chunk and a new prompt) through the Gated DeltaNet backend gives the same
output and written states with the Triton conv kernels as with the torch forms, in float32 and
bfloat16 (the delta rule in its torch form in both).
Run (GPU machine): PYTHONPATH=. python -m pytest tests/kernels/test_gated_delta_net_conv_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_gated_delta_net_conv import TORCH_CONV, TRITON_CONV, mixed_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_with_the_triton_conv_equals_the_torch_forms(dtype):
    device = torch.device("cuda")
    expected = mixed_step(device, dtype, TORCH_CONV)
    actual = mixed_step(device, dtype, TRITON_CONV)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])
