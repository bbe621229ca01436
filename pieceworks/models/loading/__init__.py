"""Model loading: what a ``model`` string names (sources, presets), HF and GGUF checkpoints, and
the config checks that refuse what an architecture does not implement."""
