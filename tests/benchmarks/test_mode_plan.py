"""``plan_modes``: named modes reconciled with the user's flags, then merged by effective
configuration. A fake resolver stands in for the engine config (the CPU's "no static graphs"
is one line of it).

Run: pytest tests/benchmarks/test_mode_plan.py
"""

from __future__ import annotations

import pytest

from pieceworks.benchmarks.mode_plan import ModeConflictError, plan_modes
from pieceworks.core.config import CompilationConfig


def resolver(has_graphs: bool):
    def resolve(fields):
        config = CompilationConfig(**fields)
        graphs = config.cudagraph_mode.name if has_graphs else "NONE"
        return int(config.level), graphs, config.backend or "inductor"

    return resolve


def names(plans):
    return [(p.name, p.level, p.graph_mode, p.merged) for p in plans]


def test_defaults_follow_the_platform():
    cpu = plan_modes(None, {}, False, False, resolver(False))
    assert names(cpu) == [("eager", 0, "NONE", []), ("compiled", 3, "NONE", [])]
    gpu = plan_modes(None, {}, False, True, resolver(True))
    assert [p.name for p in gpu] == ["eager", "piecewise", "full_and_piecewise"]


def test_modes_that_resolve_alike_run_once_under_the_first_name():
    plans = plan_modes("compiled,piecewise,full,eager", {}, False, False, resolver(False))
    assert names(plans) == [
        ("compiled", 3, "NONE", ["piecewise", "full"]),
        ("eager", 0, "NONE", []),
    ]
    # With graphs every one of them differs.
    assert len(plan_modes("compiled,piecewise,full", {}, False, True, resolver(True))) == 3


def test_flags_alone_make_one_row_named_after_what_they_ask_for():
    assert names(plan_modes(None, {"level": 0}, False, True, resolver(True))) == [
        ("eager", 0, "NONE", [])
    ]
    assert names(plan_modes(None, {}, True, True, resolver(True))) == [("eager", 0, "NONE", [])]
    level2 = plan_modes(None, {"level": 2}, False, True, resolver(True))
    assert names(level2) == [("O2_none", 2, "NONE", [])]
    assert level2[0].compilation["level"] == 2


@pytest.mark.parametrize(
    "modes, fields, enforce_eager, words",
    [
        ("compiled", {"level": 0}, False, "runs compile level 3, but -O"),
        ("eager,piecewise", {}, True, "--enforce-eager asks for level 0"),
        ("piecewise", {"cudagraph_mode": "FULL"}, False, "captures PIECEWISE graphs"),
    ],
)
def test_a_mode_against_a_flag_is_refused(modes, fields, enforce_eager, words):
    with pytest.raises(ModeConflictError, match=words):
        plan_modes(modes, fields, enforce_eager, True, resolver(True))


def test_a_matching_flag_is_fine_and_other_fields_travel_with_every_mode():
    fields = {"level": 3, "backend": "eager"}
    plans = plan_modes("piecewise,full", fields, False, True, resolver(True))
    assert [p.compilation["backend"] for p in plans] == ["eager", "eager"]
