"""``pieceworks serve`` when one request is bad: it fails alone, the server carries on.

Proves: a seed no ``torch.Generator`` takes is a 400 naming the field and its range (it used to
fail the engine step and take the server down); a step that raises fails only the request it ran,
and the next request and ``/health`` still answer 200. llama-tiny at level 0, loopback only.
Run: pytest tests/entrypoints/test_serve_bad_request.py
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")

from pieceworks.engine.llm import LLM  # noqa: E402
from tests.entrypoints.server import running_server  # noqa: E402

BODY = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}


@pytest.fixture  # the server shuts its engine down when it stops
def llm():
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)


def test_an_overflowing_seed_is_a_400_and_the_server_carries_on(llm):
    with running_server(llm, "llama-tiny") as (url, _):
        bad = httpx.post(f"{url}/v1/completions", json={**BODY, "seed": 2**70}, timeout=30)
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert "seed=" in error["message"] and "2**64 - 1" in error["message"]
        assert error["param"] == "seed"
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=30).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_failing_step_fails_its_request_only(llm, monkeypatch):
    runner = llm.engine.runner
    real_execute = runner.execute_async
    failing = {"on": True}

    def execute(output, grammar=None):
        if failing["on"]:
            failing["on"] = False
            raise RuntimeError("injected failure")
        return real_execute(output, grammar)

    monkeypatch.setattr(runner, "execute_async", execute)
    with running_server(llm, "llama-tiny") as (url, _):
        first = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert first.status_code >= 400
        assert "injected failure" in first.json()["error"]["message"]
        later = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert later.status_code == 200
        assert later.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(f"{url}/health").status_code == 200
