"""Fixtures of the worker tests."""

from __future__ import annotations

import pytest

from pieceworks.worker import input_buffers


@pytest.fixture(params=["merged", "per_field"])
def copy_gap(request, monkeypatch):
    """Run twice: with the default merging, and with every field copied on its own (exactly
    its used rows), so a row count that is off by one cannot hide inside a merged copy."""
    if request.param == "per_field":
        monkeypatch.setattr(input_buffers, "MAX_COPY_GAP_BYTES", 0)
