"""``pieceworks serve`` as a process: SIGTERM drains the request in flight, then the server exits.

Proves: the CLI starts a server (llama-tiny, level 0, a port the OS picks); a stream that is
running when SIGTERM arrives still gets every token it asked for and its ``[DONE]``; the process
then exits by itself (uvicorn re-raises the signal after shutting down), having stopped its
engine process (no child is left). Loopback only, one request, bounded by timeouts.
Run: pytest tests/entrypoints/test_serve_sigterm.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.entrypoints.server import is_gone, spawned_children  # noqa: E402

MAX_TOKENS = 200


def _start_server() -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "pieceworks.entrypoints.cli", "serve", "llama-tiny"]
    command += ["-O", "0", "--dtype", "float32", "--port", "0", "--max-num-seqs", "4"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 180
    assert process.stderr is not None
    for line in process.stderr:
        found = re.search(r"Uvicorn running on (http://\S+)", line)
        if found:  # keep reading its log, so a full pipe never blocks the server
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, found.group(1)
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError("the server process did not start")


def test_sigterm_drains_the_stream_in_flight():
    process, url = _start_server()
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
