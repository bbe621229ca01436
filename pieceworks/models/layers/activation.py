"""``silu_and_mul``: the gated activation of Llama-style MLPs, on a merged gate/up projection.

The layer-level name of the torch form in ``kernels/activation/torch_activation.py``; input
``(num_tokens, 2 * d)``, output ``(num_tokens, d)``. The MLP reaches it through
``LinearMethod.apply_silu_and_mul``, which in compiled decode graphs runs it as the gate/up GEMV's
epilogue instead (``kernels/gemv/triton_gemv.py``).
"""

from pieceworks.kernels.activation.torch_activation import silu_and_mul

__all__ = ["silu_and_mul"]
