"""Paged attention: the layer (the graph's split point), its metadata, and the kernel backends."""
