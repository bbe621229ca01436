"""The executor's launch helpers, in this process (no rank is started).

Proves: ``torchrun_env`` reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (``LOCAL_RANK``
defaulting to the rank), and is None unless both ``RANK`` and ``WORLD_SIZE`` are set;
``free_tcp_init_method`` names a port of 127.0.0.1 that can be bound; a worker's reported error
reads ``rank r:`` and its traceback, and an executor that spawned no worker has none to report.
Run: pytest tests/worker/test_executor.py
"""

from __future__ import annotations

import queue
import re
import socket

import pytest

from pieceworks.worker.executor import MultiprocExecutor, free_tcp_init_method, torchrun_env


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, (1, 2, 0)),
        ({"RANK": "3", "WORLD_SIZE": "4"}, (3, 4, 3)),
        ({"RANK": "1"}, None),
        ({"WORLD_SIZE": "2"}, None),
        ({}, None),
    ],
)
def test_torchrun_env_reads_the_launcher_s_variables(monkeypatch, env, expected):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launched = torchrun_env()
    if expected is None:
        assert launched is None
    else:
        assert launched == dict(zip(("rank", "world_size", "local_rank"), expected))


def test_free_tcp_init_method_names_a_free_local_port():
    match = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", free_tcp_init_method())
    assert match is not None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", int(match[1])))


def test_a_worker_s_error_is_reported_with_its_rank():
    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # no ranks started
    executor.errors, executor.processes = None, []
    assert executor._worker_failure(wait_seconds=0.0) is None
    executor.errors = queue.Queue()
    executor.errors.put((1, "Traceback: boom"))
    assert executor._worker_failure(wait_seconds=0.0) == "rank 1:\nTraceback: boom"
    assert executor._worker_failure(wait_seconds=0.0) is None  # nothing more reported
