"""``pieceworks serve`` as a process: SIGTERM drains the request in flight, then the server exits.

Proves: the CLI starts a server (llama-tiny, level 0, a port the OS picks); a stream that is
running when SIGTERM arrives still gets every token it asked for and its ``[DONE]``; the process
then exits by itself (uvicorn re-raises the signal after shutting down), having stopped its
engine process (no child is left). Loopback only, one request, bounded by timeouts.
Run: pytest tests/entrypoints/test_serve_sigterm.py
"""

from __future__ import annotations

import json
import signal

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.entrypoints.server import is_gone, spawned_children, start_cli_server  # noqa: E402

MAX_TOKENS = 200


def test_sigterm_drains_the_stream_in_flight():
    flags = ["-O", "0", "--dtype", "float32", "--max-num-seqs", "4"]
    process, url = start_cli_server("llama-tiny", *flags)
    try:
        (engine_pid,) = spawned_children(process.pid)  # the engine runs in its own process
        body = {"prompt": [1, 2, 3], "max_tokens": MAX_TOKENS, "stream": True}
        body |= {"return_token_ids": True, "ignore_eos": True}
        tokens, done = [], False
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    if len(tokens) == 1:
                        process.send_signal(signal.SIGTERM)
        assert done and len(tokens) == MAX_TOKENS
        # uvicorn re-raises the signal once it has shut down, so the exit is by SIGTERM.
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert is_gone(engine_pid)  # the server stopped its engine process before it left
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
