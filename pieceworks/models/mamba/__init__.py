"""Mamba2: the mixer layer (a split point, like attention), its state cache and its kernels."""
