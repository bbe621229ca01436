"""``pieceworks serve`` when the engine fails: 503s and a failing ``/health``, no hang.

Proves: if an engine step raises, the request in flight gets 503 with the engine's error, every
later request gets 503 at once, and ``/health`` answers 503, so an orchestrator restarts the
server; nothing waits forever. llama-tiny at level 0, loopback only.
Run: pytest tests/entrypoints/test_serve_engine_failure.py
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")

from pieceworks.engine.llm import LLM  # noqa: E402
from tests.entrypoints.server import running_server  # noqa: E402


def test_a_failing_step_gives_503_and_unhealthy():
    llm = LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)

    def broken_step():
        raise RuntimeError("device lost")

    llm.engine.step = broken_step  # the engine loop's next step raises
    with running_server(llm, "llama-tiny") as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200
        body = {"prompt": [1, 2, 3], "max_tokens": 4}
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 503
        assert "device lost" in first.json()["error"]["message"]
        later = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert later.status_code == 503
        assert httpx.get(f"{url}/health").status_code == 503
