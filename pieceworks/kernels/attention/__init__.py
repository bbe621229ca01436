"""Attention kernels: the paged-KV store (``kv_cache.py``) and paged attention for prefill, decode
and mixed batches: planned and launched by ``triton_attention.py``, whose kernels are the decode
split-KV pair (``triton_decode_attention.py``) and the prefill / mixed flash kernel
(``triton_prefill_attention.py``), built from shared tiles (``triton_attention_tiles.py``), with
the prebound launch they share (``kernels/kernel_launch.py``) and decode's split-KV workspace
(``workspace.py``). The torch reference is ``models/attention/ops/reference.py``."""
