"""Hardware backends and the lazy, once-per-process ``current_platform()``.

Importing this package resolves nothing: the first call to ``current_platform()`` probes and
remembers the result and how it was reached (``describe_platform_resolution()``).
"""

from __future__ import annotations

from pieceworks.platforms.capability import PlatformCapabilities
from pieceworks.platforms.contract import CONTRACT_VERSION, PlatformContractError
from pieceworks.platforms.interface import Platform
from pieceworks.platforms.registry import (
    PlatformResolution,
    register_platform_plugin,
    resolve_platform,
    unregister_platform_plugin,
)

_current: Platform | None = None
_resolution: PlatformResolution | None = None


def current_platform() -> Platform:
    """The platform this process runs on, resolved on first use."""
    global _current, _resolution
    if _current is None:
        _current, _resolution = resolve_platform()
    return _current


def platform_resolution() -> PlatformResolution:
    """How ``current_platform()`` was chosen (resolving it if needed)."""
    current_platform()
    assert _resolution is not None
    return _resolution


def describe_platform_resolution() -> str:
    return platform_resolution().describe()


def is_platform_resolved() -> bool:
    return _current is not None


def reset_platform() -> None:
    """Forget the resolved platform (tests, and `pieceworks platforms` after changing env)."""
    global _current, _resolution
    _current = _resolution = None


def use_platform(platform_cls: type[Platform]) -> Platform:
    """Make a fresh ``platform_cls()`` the current platform: a tensor-parallel worker process
    takes its parent's resolved platform this way instead of resolving again."""
    global _current, _resolution
    _current, _resolution = platform_cls(), None
    return _current


__all__ = [
    "CONTRACT_VERSION",
    "Platform",
    "PlatformCapabilities",
    "PlatformContractError",
    "PlatformResolution",
    "current_platform",
    "describe_platform_resolution",
    "is_platform_resolved",
    "platform_resolution",
    "register_platform_plugin",
    "reset_platform",
    "unregister_platform_plugin",
    "use_platform",
]
