"""The rotary embedding's torch form; its fused Triton form is the qkv GEMV's epilogue
(``kernels/gemv/triton_gemv_rope.py``)."""
