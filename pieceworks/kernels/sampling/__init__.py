"""Sampling kernels: the greedy row argmax over the logits (``triton_argmax.py``)."""
