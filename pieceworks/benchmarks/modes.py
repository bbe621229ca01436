"""Named run modes for the CLI and the benchmark: a compile level plus a static-graph mode.

``eager`` is vLLM's ``enforce_eager`` (no compilation, no graphs). ``breakable`` and
``breakable_piecewise`` compile nothing either (level 0) but capture the eager forward as breakable
graphs: segments ended at each splitting op (``core/breakable_graph.py``); ``breakable`` also
captures uniform decode batches whole (FULL). The others compile at level 3 and differ only in
which graphs they capture. On a platform without static graphs every mode but ``eager`` runs
without graphs (the platform turns them off, and the report says so).
"""

from __future__ import annotations

from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode

MODES: dict[str, tuple[CompilationLevel, CUDAGraphMode]] = {
    "eager": (CompilationLevel.NO_COMPILATION, CUDAGraphMode.NONE),
    "compiled": (CompilationLevel.PIECEWISE, CUDAGraphMode.NONE),
    "piecewise": (CompilationLevel.PIECEWISE, CUDAGraphMode.PIECEWISE),
    "full": (CompilationLevel.PIECEWISE, CUDAGraphMode.FULL),
    "full_decode_only": (CompilationLevel.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY),
    "full_and_piecewise": (CompilationLevel.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE),
    "breakable": (CompilationLevel.NO_COMPILATION, CUDAGraphMode.FULL_AND_PIECEWISE),
    "breakable_piecewise": (CompilationLevel.NO_COMPILATION, CUDAGraphMode.PIECEWISE),
}


def parse_modes(text: str) -> list[str]:
    modes = [mode.strip() for mode in text.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    return modes


def compilation_for_mode(mode: str, base: dict | None = None) -> CompilationConfig:
    """A CompilationConfig for ``mode``, on top of user fields in ``base``."""
    level, graph_mode = MODES[mode]
    fields = dict(base or {})
    fields.update(level=level, cudagraph_mode=graph_mode)
    return CompilationConfig.from_fields(fields)


def default_modes(has_static_graphs: bool) -> list[str]:
    return (
        ["eager", "piecewise", "full_and_piecewise"] if has_static_graphs else ["eager", "compiled"]
    )
