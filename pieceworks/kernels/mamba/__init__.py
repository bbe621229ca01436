"""Mamba2 mixer-core Triton kernels: causal conv1d with state (``causal_conv1d.py``), the chunked
SSD scan for prefill (``ssd_scan.py``) and the single-step state update for decode
(``selective_state_update.py``). Their float32 torch references are ``models/mamba/ops``."""
