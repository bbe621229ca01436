"""The causal conv1d's entries in the kernel registry: the Mamba2 Triton kernels, for a layer that
asks the chooser for its conv.

- ``causal_conv1d_update``: one decode token per sequence over conv-state slots; ``triton``
  (``causal_conv1d.causal_conv1d_update``, capturable in a FULL graph) or ``torch``;
- ``causal_conv1d_varlen``: packed prefill sequences, each from its slot or from zeros; ``triton``
  (``causal_conv1d.causal_conv1d_varlen``) or ``torch``.

The Gated DeltaNet layer asks for both (``GatedDeltaNet.choose_kernels``); the ``torch`` entries
carry no ``fn``: the layer keeps its own torch forms (``models/gated_delta_net/backend.py``), of
the same semantics (depthwise conv, SiLU, float32 accumulation, the last ``d_conv - 1`` inputs
left in the slot). Mamba2 mixers launch the same kernels through their platform backend
(``models/mamba/backends.py``), not through these entries. The Triton entries need a device with
Triton and a float16, bfloat16 or float32 model. Listing the entries imports no Triton: each
``fn`` imports the kernel module at its first call.
"""

from __future__ import annotations

import torch

from pieceworks.kernels.implementation import KernelImpl, Supports
from pieceworks.platforms.capability import TRITON

CONV_UPDATE_OP = "causal_conv1d_update"
CONV_VARLEN_OP = "causal_conv1d_varlen"
TRITON_CONV_SUPPORTS = Supports(
    features=frozenset({TRITON}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
)


def triton_causal_conv1d_update(x, conv_state, weight, bias, state_indices) -> torch.Tensor:
    """``causal_conv1d.causal_conv1d_update``: (S, conv_dim) decode rows -> (S, conv_dim)."""
    from pieceworks.kernels.mamba.causal_conv1d import causal_conv1d_update

    return causal_conv1d_update(x, conv_state, weight, bias, state_indices)


def triton_causal_conv1d_varlen(
    x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state
) -> torch.Tensor:
    """``causal_conv1d.causal_conv1d_varlen``: (T, conv_dim) packed tokens -> (T, conv_dim)."""
    from pieceworks.kernels.mamba.causal_conv1d import causal_conv1d_varlen

    return causal_conv1d_varlen(
        x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state
    )


def causal_conv1d_kernels() -> list[KernelImpl]:
    """The two Triton kernels (priority 10) and the two torch forms (native, no ``fn``)."""
    return [
        KernelImpl(
            CONV_UPDATE_OP, "triton", TRITON_CONV_SUPPORTS, triton_causal_conv1d_update, 10,
            jitted=True,
        ),
        KernelImpl(
            CONV_VARLEN_OP, "triton", TRITON_CONV_SUPPORTS, triton_causal_conv1d_varlen, 10,
            jitted=True,
        ),
        KernelImpl(CONV_UPDATE_OP, "torch", native=True),
        KernelImpl(CONV_VARLEN_OP, "torch", native=True),
    ]  # fmt: skip
