"""The decode GEMV family: the Triton GEMV with its epilogues (``triton_gemv.py``), its rotary
form (``triton_gemv_rope.py``), the resident-weight Gluon GEMV for Hopper (``resident_gemv.py``)
and the launch configurations (``triton_gemv_config.py``)."""
