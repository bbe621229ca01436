"""A real ``pieceworks serve`` app on a loopback port, in a background thread, for tests.

``running_server(engine, ...)`` builds the app as ``cmd_serve`` does, over either an ``LLM``
(its engine then runs on a thread of the test process, ``--engine-in-process``) or an
``EngineSpec`` (the engine is built in a process of its own, the default of ``pieceworks
serve``), and runs uvicorn on 127.0.0.1 with a port the OS picks; it yields the base URL and the
serving context, and stops the server (draining it, then stopping the engine) on exit.
``start_cli_server`` runs ``pieceworks serve`` as a process instead (a ``CliServer``, which keeps
its log); ``finished_counts`` reads a server's finished choices per reason from ``/metrics``;
the ``/proc`` helpers find a server's engine process and tell whether a process is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from pieceworks.engine.core_process import EngineSpec
from pieceworks.entrypoints.serve import build_context, build_process_context
from pieceworks.entrypoints.serve.api_server import build_app


@contextlib.contextmanager
def running_server(
    engine: Any, model_name: str, max_waiting_requests: int = 256, **app_options: Any
) -> Iterator[tuple[str, Any]]:
    if isinstance(engine, EngineSpec):
        ctx = build_process_context(engine, model_name, max_waiting_requests)
    else:
        ctx = build_context(engine, model_name, max_waiting_requests)
    try:
        app = build_app(ctx, [model_name], **app_options)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}", ctx
        finally:
            server.should_exit = True
            thread.join(60)
    finally:
        ctx.engine.shutdown()  # a no-op after the app's own shutdown


def finished_counts(url: str) -> dict[str, float]:
    """``pieceworks:request_success_total`` of the server at ``url``, by finish reason."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = r'request_success_total\{finished_reason="(\w+)",model_name="[^"]+"\} (\S+)'
    return {reason: float(value) for reason, value in re.findall(pattern, text)}


@dataclasses.dataclass
class CliServer:
    """A ``pieceworks serve`` process, its URL, and the lines of its log read so far."""

    process: subprocess.Popen
    url: str
    log: list[str]
    reader: threading.Thread

    def log_text(self) -> str:
        """The log so far; all of it once the process has exited."""
        if self.process.poll() is not None:
            self.reader.join(10)
        return "".join(self.log)


def start_cli_server(*serve_args: str) -> CliServer:
    """``pieceworks serve *serve_args --port 0`` as a process, once uvicorn is up; its log (stderr)
    keeps being read into ``log`` by a thread, so a full pipe never blocks the server and a
    failing test can show what the server said."""
    command = [sys.executable, "-m", "pieceworks.entrypoints.cli", "serve", *serve_args]
    command += ["--port", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 180
    assert process.stderr is not None
    log: list[str] = []
    for line in process.stderr:
        log.append(line)
        found = re.search(r"Uvicorn running on (http://\S+)", line)
        if found:
            reader = threading.Thread(target=_read_lines, args=(process.stderr, log), daemon=True)
            reader.start()
            return CliServer(process, found.group(1), log, reader)
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError("the server process did not start; its log:\n" + "".join(log))


def _read_lines(stream: Any, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def parent_pid(pid: int) -> int:
    """The parent of ``pid``, from /proc (field 4 of ``stat``, after the command in parens)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def spawned_children(pid: int) -> list[int]:
    """Children of ``pid`` started by multiprocessing's spawn (not its resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [
        int(child)
        for child in children
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


def is_gone(pid: int) -> bool:
    """``pid`` has exited: it no longer exists, or is a zombie nobody has reaped yet."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return True
    return state == "Z"
