"""The engine with tensor_parallel_size=2 through ``LLM``: rank 0 here, rank 1 a spawned worker.

Proves, on CPU with gloo: ``LLM(..., tensor_parallel_size=2)`` spawns its worker, broadcasts every
step, and gives the greedy tokens of ``tensor_parallel_size=1``, with async scheduling and
without, eager and with FULL_AND_PIECEWISE graphs (simgraph), for Llama and Bamba; unseeded random
sampling stays in step across ranks (rank 0's ids are broadcast, so the run completes and gives
valid tokens); ``shutdown`` stops the worker; a worker that fails at start-up ends the engine's
construction with that rank's error instead of a hang.
Run: pytest tests/distributed/test_executor.py
"""

from __future__ import annotations

import time

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint
from pieceworks.sampling_params import SamplingParams
from pieceworks.worker.executor import MultiprocExecutor
from pieceworks.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts(vocab_size: int, lengths=(3, 9, 17, 5, 2)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for name in ("llama-tiny", "bamba-tiny"):
        path = tmp_path_factory.mktemp(name)
        random_hf_checkpoint(get_preset(name), path, seed=11, dtype=torch.float32)
        paths[name] = str(path)
    return paths


def generate(path: str, mode: str, tp: int, params=GREEDY, **engine_args) -> list[list[int]]:
    llm = LLM(
        path,
        compilation_config=compilation_for_mode(mode, {"backend": "eager"}),
        dtype="float32",
        max_num_seqs=4,
        tensor_parallel_size=tp,
        **engine_args,
    )
    vocab_size = llm.config.model_config.hf_config["vocab_size"]
    try:
        return [out.outputs[0].token_ids for out in llm.generate(prompts(vocab_size), params)]
    finally:
        llm.shutdown()


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("model", ["llama-tiny", "bamba-tiny"])
def test_tp2_through_llm_equals_tp1(checkpoints, graph_platform, model):
    """On CPU (gloo) both ranks share the host; on a GPU platform this needs two devices."""
    if graph_platform.device(1) != graph_platform.device(0) and graph_platform.device_count() < 2:
        pytest.skip(f"{graph_platform.name} sees fewer than 2 devices")
    path = checkpoints[model]
    for mode in ("eager", "full_and_piecewise"):
        reference = generate(path, mode, tp=1)
        assert generate(path, mode, tp=2) == reference, mode
    assert generate(path, "eager", tp=2, async_scheduling=False) == reference


def test_unseeded_sampling_stays_in_step_across_ranks(checkpoints):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    torch.manual_seed(123)  # this process's (rank 0's) default generator differs from rank 1's
    tokens = generate(checkpoints["llama-tiny"], "eager", tp=2, params=params)
    assert [len(t) for t in tokens] == [8] * 5
    assert all(0 <= t < 256 for row in tokens for t in row)


class FailsOnRankOne(ModelRunner):
    def __init__(self, config) -> None:
        if config.parallel_config.rank == 1:
            raise MemoryError("rank 1 ran out of device memory (injected)")
        super().__init__(config)


def test_failing_worker_ends_start_up_with_its_error(checkpoints):
    from pieceworks.engine.arg_utils import build_engine_config

    config = build_engine_config(
        checkpoints["llama-tiny"], {"level": 0}, dtype="float32", tensor_parallel_size=2
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1") as failure:
        MultiprocExecutor(config, runner_cls=FailsOnRankOne)
    assert "ran out of device memory (injected)" in str(failure.value)
    assert time.monotonic() - start < 120  # well inside PIECEWORKS_DIST_TIMEOUT_S


def test_more_ranks_than_devices_is_a_clear_error(monkeypatch):
    from pieceworks import platforms
    from pieceworks.worker.executor import check_device_index

    class OneDevice:
        name = "onedevice"

        def device(self, index: int = 0) -> tuple[str, int]:
            return ("accelerator", index)

        def device_count(self) -> int:
            return 1

    check_device_index(1, 2)  # the CPU: every rank shares the one device
    monkeypatch.setattr(platforms, "_current", OneDevice())
    check_device_index(0, 2)  # torchrun's rank 0 on device 0: fine
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs device 1.*sees 1"):
        check_device_index(1, 2)
