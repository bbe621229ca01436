"""Fixtures of the core tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def log_text(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """The compile cache on (the test session turns it off) and the text of the ``pieceworks``
    records logged during the test at INFO and above (call it to read)."""
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.INFO, logger="pieceworks")
    return lambda: caplog.text
