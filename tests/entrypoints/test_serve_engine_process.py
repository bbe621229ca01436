"""``pieceworks serve`` with the engine in its own process: where it runs, how it dies, how it ends.

Proves: the engine runs in a child process of the server (another pid), serves the offline
``LLM`` greedy tokens, and ignores SIGINT and SIGTERM; killing the engine process gives the
request in flight (streamed: an error event then ``[DONE]``; not streamed: 503) and every later
request the engine-failed error, and ``/health`` answers 503; leaving the server stops the engine
process; an engine that cannot be built (a bad model, a bad flag) fails ``pieceworks serve`` with
exit status 2 and the same one-line error the offline ``LLM`` raises; a server killed with
SIGKILL takes its engine process with it; with two tensor-parallel ranks the engine process
spawns rank 1 itself and serves the offline tokens; on a GPU only the engine process holds a
device context. llama-tiny at level 0, loopback only, bounded by timeouts.
Run: pytest tests/entrypoints/test_serve_engine_process.py
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from pieceworks.engine.core_process import EngineSpec  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.entrypoints.cli import main  # noqa: E402
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402
from tests.entrypoints.server import (  # noqa: E402
    is_gone,
    parent_pid,
    running_server,
    spawned_children,
    start_cli_server,
)

MODEL = "llama-tiny"
SPEC = EngineSpec(MODEL, {"level": 0}, {"dtype": "float32", "max_num_seqs": 4})
PROMPT = [5, 17, 42, 99]
IDS = {"return_token_ids": True, "ignore_eos": True}


def test_engine_runs_in_a_child_process_and_equals_offline():
    llm = LLM(SPEC.model, compilation_config=SPEC.compilation_config, **SPEC.engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    llm.shutdown()
    with running_server(SPEC, MODEL) as (url, ctx):
        engine_pid = ctx.engine.client.pid
        assert engine_pid != os.getpid()
        assert parent_pid(engine_pid) == os.getpid()
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, **IDS}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["choices"][0]["token_ids"] == offline
        # A terminal's Ctrl-C or a service manager's SIGTERM to the whole process group: the
        # engine process ignores both (the server drains, then tells it to stop).
        os.kill(engine_pid, signal.SIGINT)
        os.kill(engine_pid, signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(f"{url}/health").status_code == 200
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.json()["choices"][0]["token_ids"] == offline
    assert is_gone(engine_pid)  # leaving the server stopped and reaped the engine process


def test_killing_the_engine_process_fails_requests_and_health():
    with running_server(SPEC, MODEL) as (url, ctx):
        engine_pid = ctx.engine.client.pid

        async def run() -> tuple[list[str], httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                long = {"prompt": PROMPT, "max_tokens": 400, **IDS}
                waiting = asyncio.ensure_future(http.post("/v1/completions", json=long))
                events = []
                stream_body = {**long, "stream": True}
                async with http.stream("POST", "/v1/completions", json=stream_body) as stream:
                    async for line in stream.aiter_lines():
                        if not line:
                            continue
                        events.append(line)
                        if len(events) == 1:  # the first token came: the engine is stepping
                            os.kill(engine_pid, signal.SIGKILL)
                return events, await waiting

        events, not_streamed = asyncio.run(asyncio.wait_for(run(), 120))
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == 503
        assert f"pid {engine_pid}" in error["message"] and "signal 9" in error["message"]
        assert not_streamed.status_code == 503
        assert "signal 9" in not_streamed.json()["error"]["message"]
        later = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, **IDS}, timeout=30)
        assert later.status_code == 503
        assert "restart the server" in later.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503


@pytest.mark.parametrize(
    "argv",
    [
        ["no-such-model"],  # neither a preset, a directory nor a GGUF file
        ["llama-tiny", "--max-model-len", "0"],
    ],
)
def test_an_engine_that_cannot_be_built_is_one_error_line(argv, capsys):
    in_process = main(["serve", *argv, "--engine-in-process", "-O", "0", "--port", "0"])
    expected = capsys.readouterr().err
    assert in_process == 2 and expected.startswith("error: ")
    assert main(["serve", *argv, "-O", "0", "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == expected.strip()


def test_a_killed_server_takes_its_engine_process_with_it():
    server = start_cli_server(MODEL, "-O", "0", "--dtype", "float32", "--max-num-seqs", "2").process
    try:
        (engine_pid,) = spawned_children(server.pid)
        server.kill()
        server.wait(30)
        deadline = time.monotonic() + 30
        while not is_gone(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert is_gone(engine_pid)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_tensor_parallel_engine_process_has_its_rank_workers(tmp_path):
    """The engine process is not daemonic: with two ranks it spawns rank 1 itself."""
    random_hf_checkpoint(get_preset(MODEL), tmp_path, seed=11, dtype=torch.float32)
    engine_args = {"dtype": "float32", "max_num_seqs": 2}
    llm = LLM(str(tmp_path), compilation_config={"level": 0}, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    offline = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    llm.shutdown()
    spec = EngineSpec(str(tmp_path), {"level": 0}, {**engine_args, "tensor_parallel_size": 2})
    with running_server(spec, MODEL) as (url, ctx):
        (rank1_pid,) = spawned_children(ctx.engine.client.pid)
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, **IDS}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.json()["choices"][0]["token_ids"] == offline
    assert is_gone(rank1_pid) and is_gone(ctx.engine.client.pid)


@pytest.mark.gpu
def test_only_the_engine_process_holds_a_device_context():
    """The server process never initialises CUDA: nvidia-smi lists only its engine process."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi to list the processes holding a CUDA context")
    cli = start_cli_server(MODEL, "-O", "0", "--max-num-seqs", "2")
    server, url = cli.process, cli.url
    try:
        (engine_pid,) = spawned_children(server.pid)
        assert httpx.get(f"{url}/health").status_code == 200
        listed = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert str(engine_pid) in listed and str(server.pid) not in listed
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
