"""Attention kernels: the paged-KV store (``kv_cache.py``) and paged attention for prefill, decode
and mixed batches (``triton_attention.py``), with the prebound launch they share (``launch.py``)
and decode's split-KV workspace (``workspace.py``). The torch reference is
``models/attention/ops/reference.py``."""
