"""The compile cache: its key and hash factors, the on-disk store of compiled pieces, why a key
missed, and where Triton keeps its binaries."""
