"""``LLM(..., tensor_parallel_size=2)`` under torchrun-style environment variables (CPU, gloo).

Proves: two processes launched with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (what torchrun sets), each running the same script, form the two ranks without
spawning anything; rank 0 generates the tokens one process gives, and rank 1 serves rank 0's
steps inside ``LLM(...)`` and leaves with exit code 0 when rank 0 shuts down, never reaching the
rest of the script.
Run: pytest tests/distributed/test_torchrun.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import random_hf_checkpoint
from pieceworks.sampling_params import SamplingParams
from pieceworks.worker.executor import free_tcp_init_method

SCRIPT = """
import json, sys
from pieceworks.engine.llm import LLM
from pieceworks.sampling_params import SamplingParams
llm = LLM(sys.argv[1], compilation_config={"level": 0}, dtype="float32", max_num_seqs=4,
          tensor_parallel_size=2)
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
tokens = [o.outputs[0].token_ids for o in llm.generate(json.loads(sys.argv[2]), params)]
llm.shutdown()
print("TOKENS " + json.dumps(tokens), flush=True)
"""
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


def test_torchrun_environment_forms_the_ranks(tmp_path: Path):
    random_hf_checkpoint("llama-tiny", tmp_path, seed=2, dtype=torch.float32)
    llm = LLM(str(tmp_path), compilation_config={"level": 0}, dtype="float32", max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    port = free_tcp_init_method().rsplit(":", 1)[1]
    processes = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PIECEWORKS_PLATFORM="cpu",
                   PIECEWORKS_DIST_TIMEOUT_S="60")  # fmt: skip
        command = [sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(PROMPTS)]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [process.communicate(timeout=180)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0]
    rank0 = [line for line in outputs[0].splitlines() if line.startswith("TOKENS ")]
    assert rank0 and json.loads(rank0[0].removeprefix("TOKENS ")) == expected
    assert "TOKENS" not in outputs[1]  # rank 1 left inside LLM(...)
