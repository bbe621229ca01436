"""The gated activations: their torch forms (``torch_activation.py``), the Triton kernel of
``silu_and_mul`` for products the GEMV epilogue does not take (``triton_silu_and_mul.py``) and
the Triton kernel of ``gelu_and_mul`` (``triton_gelu_and_mul.py``)."""
