"""pieceworks: trace once, split at the dynamic ops, compile the pieces, replay static graphs.

Importing pieceworks resolves no platform and writes no torch flags; the heavy entry points
(``LLM``, ``SamplingParams``) are imported on first access. The platform package is imported (not
resolved) here, so that every ``EngineConfig`` is adjusted for ``current_platform()`` however it was
imported.
"""

from __future__ import annotations

from typing import Any

import pieceworks.platforms  # noqa: F401  (installs the EngineConfig platform provider)

__version__ = "0.1.0"

_LAZY = {"LLM": "pieceworks.engine.llm", "SamplingParams": "pieceworks.sampling_params"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pieceworks' has no attribute {name!r}")
