"""``SimGraphPlatform``: the CPU platform plus simulated static graphs.

Everything but graphs and one kernel is inherited from pieceworks' CPU platform; the platform
names its static-graph wrapper, provides a process-wide pool object and, when it is made,
registers its own RMSNorm kernel with pieceworks' chooser (``kernels.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pieceworks.platforms.cpu import CpuPlatform


class SimGraphPool:
    """Stands in for a device graph pool: one per process, shared by every captured graph."""

    def __init__(self) -> None:
        self.num_graphs = 0


class SimGraphPlatform(CpuPlatform):
    contract_version: ClassVar[tuple[int, int]] = (1, 2)  # the platform contract it implements
    name: ClassVar[str] = "simgraph"
    static_graph_wrapper: ClassVar[str | None] = "pieceworks_simgraph.wrapper.SimGraphWrapper"

    def __init__(self) -> None:
        super().__init__()
        from pieceworks_simgraph.kernels import register_kernels

        register_kernels()  # chosen only while this platform is the current one

    @classmethod
    def is_available(cls) -> bool:
        return True  # CPU-hosted: available wherever pieceworks runs

    def _create_graph_pool(self) -> Any:
        return SimGraphPool()
