"""``SimGraphPlatform``: the CPU platform plus simulated static graphs.

Everything but graphs is inherited from pieceworks' CPU platform; the platform only names its
static-graph wrapper and provides a process-wide pool object.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pieceworks.platforms.cpu import CpuPlatform


class SimGraphPool:
    """Stands in for a device graph pool: one per process, shared by every captured graph."""

    def __init__(self) -> None:
        self.num_graphs = 0


class SimGraphPlatform(CpuPlatform):
    name: ClassVar[str] = "simgraph"
    static_graph_wrapper: ClassVar[str | None] = "pieceworks_simgraph.wrapper.SimGraphWrapper"

    @classmethod
    def is_available(cls) -> bool:
        return True  # CPU-hosted: available wherever pieceworks runs

    def _create_graph_pool(self) -> Any:
        return SimGraphPool()
