"""``pieceworks serve`` as a process: SIGTERM drains the request in flight, then the server exits.

Proves: the CLI starts a server (llama-tiny, level 0, a port the OS picks); a stream that is
running when SIGTERM arrives (the signal goes with its first chunk of tokens, and uvicorn's log
says it waited for the connection) still gets every token it asked for and its ``[DONE]``; the
process then exits by itself (uvicorn re-raises the signal after shutting down), having stopped
its engine process (no child is left). Loopback only, one request, bounded by timeouts; a
failure shows the server's log.
Run: pytest tests/entrypoints/test_serve_sigterm.py
"""

from __future__ import annotations

import json
import signal

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.entrypoints.server import is_gone, spawned_children, start_cli_server  # noqa: E402

# Long enough that the stream is still running when the signal is handled: the engine may run
# several steps before the server sends the first chunk, which then carries all their tokens.
MAX_TOKENS = 500


def test_sigterm_drains_the_stream_in_flight():
    flags = ["-O", "0", "--dtype", "float32", "--max-num-seqs", "4"]
    server = start_cli_server("llama-tiny", *flags)
    process = server.process
    try:
        (engine_pid,) = spawned_children(process.pid)  # the engine runs in its own process
        body = {"prompt": [1, 2, 3], "max_tokens": MAX_TOKENS, "stream": True}
        body |= {"return_token_ids": True, "ignore_eos": True}
        tokens: list[int] = []
        tokens_at_signal, done = None, False
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    if tokens and tokens_at_signal is None:
                        process.send_signal(signal.SIGTERM)
                        tokens_at_signal = len(tokens)
        assert tokens_at_signal is not None and tokens_at_signal < MAX_TOKENS, server.log_text()
        assert done and len(tokens) == MAX_TOKENS, server.log_text()
        # uvicorn re-raises the signal once it has shut down, so the exit is by SIGTERM.
        assert process.wait(timeout=60) in (0, -signal.SIGTERM), server.log_text()
        assert is_gone(engine_pid)  # the server stopped its engine process before it left
        assert "Waiting for connections to close" in server.log_text()  # the stream was running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
