"""Warm starts without a trace: the traced split graph stored on disk, and the forward rebuilt
from it."""
