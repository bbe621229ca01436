"""``pieceworks run``'s kernel lines say once, and truly, why the Triton kernels were passed over.

Proves: on the CPU platform, with Triton installed, the report does not say "needs triton" per
op (which read as "Triton is missing"): each Triton kernel points to one footnote that says
Triton is installed but compiles only for a GPU; without Triton the footnote says how to
install it.
Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/entrypoints/test_run_kernels.py -q``.
"""

from __future__ import annotations

import importlib.util

import pytest

from pieceworks.entrypoints import run
from pieceworks.kernels.chooser import describe_kernel_choices
from pieceworks.platforms import current_platform


@pytest.fixture(autouse=True)
def _cpu_only():
    if current_platform().device_capability().has("triton"):
        pytest.skip("Triton compiles on this device: nothing is passed over for it")


def test_the_triton_reason_is_said_once_and_truly():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed here")
    text = run.format_kernel_choices(describe_kernel_choices())
    assert "needs triton" not in text
    assert text.count("Triton is installed") == 1
    assert "not on cpu" in text


def test_without_triton_it_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" else real_find_spec(name, *a),
    )
    assert run.format_kernel_choices(describe_kernel_choices()).count("pip install triton") == 1
