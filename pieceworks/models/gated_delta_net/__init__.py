"""Gated DeltaNet, the linear-attention mixer of Qwen3.5: the layer and its opaque op
(``mixer.py``), and the decode / prefill split over its state slots (``backend.py``)."""
