"""RMSNorm (+ residual add) with static FP8 quantization in one Triton kernel
(``triton_norm_quant.py``)."""
