"""pieceworks-simgraph: the entry point pieceworks calls to ask whether this platform is active.

Registered in ``pyproject.toml`` under the group ``pieceworks.platforms``. A real vendor's function
would check for its device and driver; a simulated platform activates only when asked for by name.
"""

from __future__ import annotations

PLATFORM_QUALNAME = "pieceworks_simgraph.platform.SimGraphPlatform"


def register() -> str | None:
    """Return the platform's qualname if the user asked for simgraph, else decline (None)."""
    from pieceworks import envs

    asked = envs.PIECEWORKS_PLATFORM == "simgraph" or "simgraph" in (envs.PIECEWORKS_PLUGINS or [])
    return PLATFORM_QUALNAME if asked else None
