"""The gated delta rule's entries in the kernel registry: two ops, each with its torch form and
flash-linear-attention's kernel.

- ``chunk_gated_delta_rule``: packed prefill sequences over state slots (prefill and mixed
  steps); ``fla_chunk`` (fla's ``chunk_gated_delta_rule``) or ``torch``;
- ``recurrent_gated_delta_rule``: decode rows over state slots; ``fla_fused_recurrent`` (fla's
  ``fused_recurrent_gated_delta_rule``) or ``torch``.

Each entry's ``fn`` is the function the Gated DeltaNet layer calls (the same signature in both,
``torch_state_slots.py``). fla's entries need an NVIDIA or AMD device with Triton (the CUDA and
ROCm platforms), a float16, bfloat16 or float32 model, key heads of at most 256 (its chunked
kernels keep a state block of ``Dk`` rows) and the ``fla-core`` and ``einops`` packages (the
``fla`` extra); elsewhere, or with ``custom_ops`` ``-chunk_gated_delta_rule`` /
``-recurrent_gated_delta_rule``, the torch forms run. Listing the entries imports neither fla
nor Triton.
"""

from __future__ import annotations

import torch

from pieceworks.kernels.gated_delta_rule import fla_gated_delta_rule, torch_state_slots
from pieceworks.kernels.implementation import KernelImpl, Supports
from pieceworks.platforms.capability import TRITON

CHUNK_OP = "chunk_gated_delta_rule"
RECURRENT_OP = "recurrent_gated_delta_rule"
FLA_MAX_HEAD_SIZE = 256  # chunk_gated_delta_rule_fwd_h asserts K <= 256
FLA_SUPPORTS = Supports(
    vendors=frozenset({"nvidia", "amd"}),
    features=frozenset({TRITON}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    max_head_size=FLA_MAX_HEAD_SIZE,
    packages=("fla", "einops"),
    extra="fla",
)


def gated_delta_rule_kernels() -> list[KernelImpl]:
    """fla's two kernels (priority 10) and the two torch forms (native)."""
    fla, ref = fla_gated_delta_rule, torch_state_slots
    return [
        KernelImpl(
            CHUNK_OP, "fla_chunk", FLA_SUPPORTS, fla.chunk_gated_delta_rule_varlen, 10,
            jitted=True,
        ),
        KernelImpl(
            RECURRENT_OP, "fla_fused_recurrent", FLA_SUPPORTS,
            fla.recurrent_gated_delta_rule_slots, 10, jitted=True,
        ),
        KernelImpl(CHUNK_OP, "torch", fn=ref.chunk_gated_delta_rule_varlen, native=True),
        KernelImpl(RECURRENT_OP, "torch", fn=ref.recurrent_gated_delta_rule_slots, native=True),
    ]  # fmt: skip
