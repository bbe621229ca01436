"""The gated activation: its torch form (``torch_activation.py``) and its Triton kernel for
products the GEMV epilogue does not take (``triton_silu_and_mul.py``)."""
