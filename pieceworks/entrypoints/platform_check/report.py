"""The conformance check's results: one ``CheckResult`` per check, the table and the JSON report.

A check is a function of ``(platform, options)`` that returns normally (pass), raises
``CheckFailed`` or any other exception (fail, with the message as the reason), or raises
``CheckSkipped`` (skipped: the platform does not declare the capability the check needs).
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from collections.abc import Callable
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skipped"


class CheckFailed(AssertionError):
    """The platform broke the contract; the message says how."""


class CheckSkipped(Exception):
    """The check needs a capability the platform does not declare; the message names it."""


@dataclasses.dataclass
class CheckResult:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str = ""  # why it failed or was skipped; what was checked where it passed
    seconds: float = 0.0


@dataclasses.dataclass
class CheckOptions:
    """What the checks run with: the compile backend of the model checks (None: the platform's
    default) and the models of the zoo to run."""

    backend: str | None = None
    models: tuple[str, ...] = ("llama-tiny", "bamba-tiny")


Check = Callable[[Any, CheckOptions], str | None]

_libraries: dict[str, Any] = {}


def check_library() -> Any:
    """The checks' own ``torch.library`` namespace, ``pieceworks_check``, made once per process."""
    if "lib" not in _libraries:
        import torch

        _libraries["lib"] = torch.library.Library("pieceworks_check", "FRAGMENT")
    return _libraries["lib"]


def run_check(name: str, check: Check, platform: Any, options: CheckOptions) -> CheckResult:
    """Run one check and record its outcome (an unexpected exception is a failure)."""
    start = time.perf_counter()
    try:
        detail = check(platform, options) or ""
        status = PASS
    except CheckSkipped as skipped:
        status, detail = SKIP, str(skipped)
    except Exception as error:  # any exception is a finding to report, never a crash of the suite
        status = FAIL
        detail = str(error) or type(error).__name__
        if not isinstance(error, CheckFailed):
            detail = f"{type(error).__name__}: {detail} (at {_where(error)})"
    return CheckResult(name, status, " ".join(detail.split()), time.perf_counter() - start)


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    frame = frames[-1] if frames else None
    return f"{frame.filename}:{frame.lineno}" if frame else "?"


def format_table(platform_name: str, header: str, results: list[CheckResult]) -> str:
    """The report as a text table: check, status, detail."""
    width = max([len(result.name) for result in results] + [5])
    lines = [f"conformance of platform {platform_name} ({header})", ""]
    lines.append(f"{'check':<{width}}  {'status':<7}  detail")
    lines.append(f"{'-' * width}  -------  ------")
    for result in results:
        lines.append(f"{result.name:<{width}}  {result.status:<7}  {result.detail}")
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL, SKIP)}
    lines.append("")
    lines.append(
        f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped (not declared)"
    )
    return "\n".join(lines)


def write_json(path: str, platform_name: str, header: str, results: list[CheckResult]) -> None:
    report = {
        "platform": platform_name,
        "capabilities": header,
        "checks": [dataclasses.asdict(result) for result in results],
        "passed": all(result.status != FAIL for result in results),
    }
    with open(path, "w") as file:
        json.dump(report, file, indent=2)
        file.write("\n")
