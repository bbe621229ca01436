"""A warm engine start in a fresh process traces nothing and answers as the traced start did.

llama-tiny at level 3 with the eager backend (the warm path is the same for Inductor, whose
artifacts ``tests/core/test_warm_start.py`` covers): a cold process traces once and stores the split
graph; a second process, same cache root, loads it (``num_dynamo_traces`` 0, no graph reaches the
backend) and its greedy tokens and logprobs equal the cold ones exactly. Once on the CPU platform
(no static graphs), once on the simgraph platform with FULL_AND_PIECEWISE, where the loaded pieces
sit in static-graph wrappers and are captured and replayed. About 40 s on 2 CPU cores.
Run: pytest tests/engine/test_warm_start_engine.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_LAYERS = 2  # llama-tiny
NUM_CAPTURABLE = NUM_LAYERS + 1  # pieces between the attention ops


def run_worker(cache_root: Path, out: Path, **env: str) -> dict:
    """``warm_start_worker`` in a fresh process with the cache on; its JSON result."""
    environment = {k: v for k, v in os.environ.items() if k != "PIECEWORKS_DISABLE_COMPILE_CACHE"}
    environment.update(env)
    command = [sys.executable, "-m", "tests.engine.warm_start_worker"]
    command += ["--cache-root", str(cache_root), "--out", str(out)]
    if "PIECEWORKS_PLATFORM" in env:
        command += ["--cudagraph-mode", "FULL_AND_PIECEWISE"]
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def simgraph_env() -> dict[str, str]:
    pytest.importorskip(
        "pieceworks_simgraph.platform", reason="pip install -e examples/pieceworks-simgraph"
    )
    return {"PIECEWORKS_PLATFORM": "simgraph"}


@pytest.mark.parametrize("platform", ["cpu", "simgraph"])
def test_warm_engine_start_loads_the_graph_and_answers_the_same(platform, tmp_path):
    env = simgraph_env() if platform == "simgraph" else {}
    cold = run_worker(tmp_path / "root", tmp_path / "cold.json", **env)
    warm = run_worker(tmp_path / "root", tmp_path / "warm.json", **env)
    assert cold["counters"]["num_dynamo_traces"] == 1
    assert cold["counters"]["num_traced_graphs_saved"] == 1
    assert warm["counters"]["num_dynamo_traces"] == 0
    assert warm["counters"]["num_traced_graphs_loaded"] == 1
    assert warm["counters"]["num_traced_graphs_saved"] == 0
    assert warm["counters"]["num_graphs_seen"] == 0  # no graph came from Dynamo
    assert warm["counters"]["num_backend_compilations"] == NUM_CAPTURABLE
    # Each capture size is captured the same way after a load as after a trace.
    assert warm["counters"]["num_cudagraph_captured"] == cold["counters"]["num_cudagraph_captured"]
    if platform == "simgraph":
        assert warm["counters"]["num_cudagraph_captured"] > 0
    assert warm["token_ids"] == cold["token_ids"]
    assert warm["logprobs"] == cold["logprobs"]
    assert all(len(tokens) == 8 for tokens in warm["token_ids"])
