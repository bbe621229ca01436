"""The platform conformance check (``pieceworks platforms --check``): runs the contract's checks
on one platform and reports each as pass, fail (why) or skipped (capability not declared).

It sits at the entrypoints level because it builds engines and models; the platform layer below
knows nothing of it. The checks: ``device_checks`` (memory and copies, the custom-op dispatch key,
FP8 formats, the kernel seam, the distributed backend), ``graph_checks`` (a toy piecewise model
under the platform's static-graph wrapper: capture/replay and the address contract, the shared
pool, FULL around PIECEWISE, breakable capture) and ``model_checks`` (the zoo's tiny models in
each declared graph mode, tokens equal to eager). ``docs/platforms.md`` says what a failure
usually means.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pieceworks.entrypoints.platform_check import device_checks, graph_checks, model_checks
from pieceworks.entrypoints.platform_check.report import (
    FAIL,
    Check,
    CheckOptions,
    CheckResult,
    format_table,
    run_check,
    write_json,
)

__all__ = ["CheckOptions", "CheckResult", "checks_for", "format_table", "run_checks", "write_json"]


def checks_for(platform: Any, options: CheckOptions) -> list[tuple[str, Check]]:
    """The checks, in order, with their report names."""
    checks: list[tuple[str, Check]] = [
        ("device memory and copies", device_checks.check_device_memory),
        ("custom-op dispatch key", device_checks.check_dispatch_key),
        ("fp8 formats", device_checks.check_fp8_formats),
        ("kernel seam", device_checks.check_kernel_seam),
        ("toy piecewise capture/replay", graph_checks.check_piecewise_replay),
        ("graph pool sharing", graph_checks.check_graph_pool),
        ("FULL around PIECEWISE", graph_checks.check_full_and_piecewise_nesting),
        ("breakable capture", graph_checks.check_breakable_capture),
    ]
    runs = model_checks.ZooRuns(options)
    modes: list[str | None] = list(model_checks.graph_modes(platform)) or [None]
    for model in options.models:
        for mode in modes:
            name = f"{model} {mode or 'graph modes'} = eager"
            checks.append((name, model_checks.model_check(runs, model, mode)))
    checks.append(("distributed init and all-reduce", device_checks.check_distributed))
    return checks


@contextmanager
def as_current_platform(platform: Any) -> Iterator[None]:
    """Make ``platform`` the current one while the checks run (wrappers and configs ask
    ``current_platform()``), then restore what was there."""
    from pieceworks import platforms

    saved = platforms._current, platforms._resolution
    platforms._current = platform
    try:
        yield
    finally:
        platforms._current, platforms._resolution = saved


def run_checks(platform: Any, options: CheckOptions | None = None) -> list[CheckResult]:
    """Every check on ``platform``; a failure never stops the ones after it."""
    options = options or CheckOptions()
    with as_current_platform(platform):
        return [
            run_check(name, check, platform, options)
            for name, check in checks_for(platform, options)
        ]


def passed(results: list[CheckResult]) -> bool:
    return all(result.status != FAIL for result in results)
