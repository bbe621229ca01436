"""``pieceworks platforms --check``: the conformance check passes on the simgraph example platform,
skips what the CPU platform does not declare, and fails a wrapper that breaks the address contract
with a message naming the fault.

The simgraph run covers every check, with both zoo models (llama-tiny and bamba-tiny) and the
eager compile backend.
Run: pytest tests/entrypoints/test_platform_check.py
"""

from __future__ import annotations

import json

import pytest
import torch

from pieceworks.entrypoints import cli, platform_check
from pieceworks.entrypoints.platform_check import graph_checks
from pieceworks.entrypoints.platform_check.report import FAIL, PASS, SKIP, CheckOptions, run_check
from pieceworks.platforms.cpu import CpuPlatform

simgraph = pytest.importorskip("pieceworks_simgraph.platform")
simgraph_wrapper = pytest.importorskip("pieceworks_simgraph.wrapper")

OPTIONS = CheckOptions(backend="eager")  # every zoo model the CLI checks


class StaleInputWrapper(simgraph_wrapper.SimGraphWrapper):
    """Records copies of its inputs at capture, so replay never sees the runner's new values."""

    def capture(self, descriptor, args, kwargs):
        copies = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        return super().capture(descriptor, copies, kwargs)


class StaleInputPlatform(simgraph.SimGraphPlatform):
    name = "stale-input"
    static_graph_wrapper = f"{__name__}.StaleInputWrapper"


@pytest.fixture(scope="module")
def simgraph_results():
    return {r.name: r for r in platform_check.run_checks(simgraph.SimGraphPlatform(), OPTIONS)}


def test_simgraph_passes_every_check(simgraph_results):
    assert {name: r.status for name, r in simgraph_results.items() if r.status != PASS} == {}
    # Every check ran: 4 device, 4 graph (breakable capture among them), 3 graph modes for each
    # of the 2 zoo models, and the distributed one.
    assert len(simgraph_results) == 4 + 4 + 3 * 2 + 1


def test_cpu_skips_what_it_does_not_declare(tmp_path, monkeypatch):
    from pieceworks import platforms

    monkeypatch.setattr(platforms, "_current", CpuPlatform())
    report = tmp_path / "report.json"
    assert cli.main(["platforms", "--check", "--output-json", str(report)]) == 0
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    skipped = {name for name, check in checks.items() if check["status"] == SKIP}
    assert skipped == {
        "toy piecewise capture/replay",
        "graph pool sharing",
        "FULL around PIECEWISE",
        "breakable capture",
        "llama-tiny graph modes = eager",
        "bamba-tiny graph modes = eager",
    }
    assert checks["breakable capture"]["detail"] == "static graphs not declared"
    assert all(c["status"] == PASS for name, c in checks.items() if name not in skipped)


def test_a_wrapper_replaying_copies_of_its_inputs_fails_the_address_check():
    platform = StaleInputPlatform()
    with platform_check.as_current_platform(platform):
        result = run_check("toy", graph_checks.check_piecewise_replay, platform, OPTIONS)
    assert result.status == FAIL
    assert result.detail.startswith("replay at size 8 (inputs copied into the static buffer;")
    assert "replays on its own copies of the captured inputs" in result.detail
