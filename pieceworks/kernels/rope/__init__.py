"""The rotary embedding's torch form (``torch_rotary.py``); its fused Triton forms: the qkv GEMV's
epilogue (``kernels/gemv/triton_gemv_rope.py``) and, for models that normalise q and k heads
first, the in-place norm and rotation after the GEMV (``triton_qk_norm_rope.py``)."""
