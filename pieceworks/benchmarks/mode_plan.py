"""Which configurations a latency run measures: named modes and the user's flags, reconciled.

A mode name (``modes.MODES``) stands for a compile level and a static-graph mode. The user's
flags (``-O``, ``--enforce-eager``, ``--compilation-config``) may fix either. ``plan_modes``
honours them or refuses the conflict:

- with ``--modes``, a mode whose level or graph mode contradicts a flag is an error that names
  both (``-O 0`` with ``compiled``: level 3 against level 0), never silently overridden;
- without ``--modes`` and with such flags, one row runs the configuration the flags ask for;
- otherwise the platform's default modes.

Each plan is then resolved the way the engine will resolve it (``build_engine_config``, the
platform's ``check_and_update_config``: the CPU turns static graphs off), and plans that end at
the same effective configuration run once, under the first name, with the others listed in
``merged`` (on the CPU ``piecewise`` and ``full_and_piecewise`` are both level 3 without graphs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pieceworks.benchmarks.modes import MODES, default_modes, parse_modes
from pieceworks.core.config import CompilationLevel, CUDAGraphMode


@dataclasses.dataclass
class ModePlan:
    """One measured row: its name, its CompilationConfig fields and what they resolve to."""

    name: str
    compilation: dict[str, Any]
    level: int = -1  # effective, after the platform's adjustments
    graph_mode: str = ""  # effective CUDAGraphMode name
    backend: str | None = None  # effective compile backend
    merged: list[str] = dataclasses.field(default_factory=list)

    @property
    def effective(self) -> tuple[int, str, str | None]:
        compiled = self.level != CompilationLevel.NO_COMPILATION
        return self.level, self.graph_mode, self.backend if compiled else None


class ModeConflictError(ValueError):
    """A named mode contradicts a flag the user gave; the message says which and what to do."""


def _user_level(fields: dict[str, Any], enforce_eager: bool) -> CompilationLevel | None:
    if enforce_eager:
        return CompilationLevel.NO_COMPILATION
    return CompilationLevel(fields["level"]) if "level" in fields else None


def _user_graph_mode(fields: dict[str, Any], enforce_eager: bool) -> CUDAGraphMode | None:
    if enforce_eager:
        return CUDAGraphMode.NONE
    mode = fields.get("cudagraph_mode")
    if mode is None:
        return None
    return CUDAGraphMode[mode.upper()] if isinstance(mode, str) else CUDAGraphMode(mode)


def _flag_words(fields: dict[str, Any], enforce_eager: bool, what: str) -> str:
    if enforce_eager:
        return "--enforce-eager"
    return f"-O / --compilation-config {what}={fields[what]!r}"


def _check_conflicts(name: str, fields: dict[str, Any], enforce_eager: bool) -> None:
    level, graph_mode = MODES[name]
    user_level = _user_level(fields, enforce_eager)
    if user_level is not None and user_level != level:
        raise ModeConflictError(
            f"mode {name!r} runs compile level {int(level)}, but "
            f"{_flag_words(fields, enforce_eager, 'level')} asks for level {int(user_level)}: "
            "drop the flag, or choose --modes that run that level, or leave out --modes"
        )
    user_graph_mode = _user_graph_mode(fields, enforce_eager)
    if user_graph_mode is not None and user_graph_mode != graph_mode:
        raise ModeConflictError(
            f"mode {name!r} captures {graph_mode.name} graphs, but "
            f"{_flag_words(fields, enforce_eager, 'cudagraph_mode')} asks for "
            f"{user_graph_mode.name}: drop one of them, or leave out --modes"
        )


def _flags_name(fields: dict[str, Any], enforce_eager: bool) -> str:
    """The row name for a run configured by flags alone: the mode it equals, else a description."""
    level = _user_level(fields, enforce_eager)
    level = CompilationLevel.PIECEWISE if level is None else level
    graph_mode = _user_graph_mode(fields, enforce_eager)
    if graph_mode is None:
        graph_mode = (
            CUDAGraphMode.FULL_AND_PIECEWISE
            if level == CompilationLevel.PIECEWISE
            else CUDAGraphMode.NONE
        )
    for name, (mode_level, mode_graphs) in MODES.items():
        if (mode_level, mode_graphs) == (level, graph_mode):
            return name
    return f"O{int(level)}_{graph_mode.name.lower()}"


def plan_modes(
    modes_text: str | None,
    fields: dict[str, Any],
    enforce_eager: bool,
    has_static_graphs: bool,
    resolve: Callable[[dict[str, Any]], tuple[int, str, str | None]],
) -> list[ModePlan]:
    """The rows to measure, deduplicated by effective configuration.

    ``fields`` are the user's CompilationConfig fields; ``resolve(fields)`` returns the effective
    (level, graph mode name, backend) the engine would run for them.
    """
    flags_set = enforce_eager or "level" in fields or "cudagraph_mode" in fields
    if modes_text:
        names = parse_modes(modes_text)
        for name in names:
            _check_conflicts(name, fields, enforce_eager)
    elif flags_set:
        names = [_flags_name(fields, enforce_eager)]
    else:
        names = default_modes(has_static_graphs)
    plans = []
    for name in dict.fromkeys(names):
        compilation = dict(fields)
        if name in MODES:
            level, graph_mode = MODES[name]
            compilation.update(level=level, cudagraph_mode=graph_mode)
        plan = ModePlan(name, compilation)
        plan.level, plan.graph_mode, plan.backend = resolve(compilation)
        plans.append(plan)
    return merge_same(plans)


def merge_same(plans: list[ModePlan]) -> list[ModePlan]:
    """Plans of the same effective configuration run once: the first keeps the others' names."""
    kept: dict[tuple[int, str, str | None], ModePlan] = {}
    for plan in plans:
        if plan.effective in kept:
            kept[plan.effective].merged.append(plan.name)
        else:
            kept[plan.effective] = plan
    return list(kept.values())
