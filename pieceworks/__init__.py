"""pieceworks: trace once, split at the dynamic ops, compile the pieces, replay static graphs.

Importing pieceworks resolves no platform and writes no torch flags; the heavy entry points
(``LLM``, ``SamplingParams``) are imported on first access. The package root is where the configs
meet the platforms: it hands ``EngineConfig`` the lookup of the platform it is adjusted for
(``set_platform_provider``), since the configs sit below the platforms and never import them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pieceworks.config import set_platform_provider

if TYPE_CHECKING:
    from pieceworks.platforms import Platform

__version__ = "0.1.0"

_LAZY = {"LLM": "pieceworks.engine.llm", "SamplingParams": "pieceworks.sampling_params"}


def _current_platform() -> Platform:
    """``current_platform()``; the platform package (and torch) load on the first EngineConfig."""
    from pieceworks.platforms import current_platform

    return current_platform()


set_platform_provider(_current_platform)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pieceworks' has no attribute {name!r}")
