"""An out-of-tree platform plugs its own kernel in through ``register_kernel``, with no edit to
pieceworks, and its declared defaults hold even where its config hook skips the base class.

The simgraph example registers ``simgraph::rms_norm`` when the platform is made; the chooser picks
it there for every RMSNorm layer, and llama-tiny runs it in eager (level 0) and compiled (level 3,
eager backend, simulated graphs) decode, with the greedy tokens of pieceworks' own RMSNorm on the
CPU platform.
Run: PYTHONPATH=.:examples/pieceworks-simgraph PIECEWORKS_PLATFORM=cpu \
    python -m pytest tests/platforms/test_vendor_kernels.py -q
"""

from __future__ import annotations

import pytest
import torch

from pieceworks import platforms
from pieceworks.config import EngineConfig
from pieceworks.core.config import CompilationConfig, CUDAGraphMode
from pieceworks.engine.llm import LLM
from pieceworks.kernels import registry
from pieceworks.models.loading.presets import random_hf_checkpoint
from pieceworks.platforms.cpu import CpuPlatform
from pieceworks.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [[5, 17, 42, 7], [100, 3]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama-tiny")
    random_hf_checkpoint("llama-tiny", path, seed=5, dtype=torch.float32)
    return str(path)


def make_llm(path: str, compilation: dict) -> LLM:
    return LLM(path, compilation_config=compilation, dtype="float32", max_num_seqs=2)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def cpu_tokens(checkpoint) -> list[list[int]]:
    return greedy_tokens(make_llm(checkpoint, {"level": 0}))


@pytest.mark.parametrize(
    "compilation",
    [{"level": 0}, {"level": 3, "backend": "eager", "cudagraph_mode": "FULL_AND_PIECEWISE"}],
    ids=["eager", "compiled"],
)
def test_simgraph_rms_norm_is_chosen_and_run(checkpoint, cpu_tokens, compilation, monkeypatch):
    simgraph_platform = pytest.importorskip("pieceworks_simgraph.platform")
    simgraph_kernels = pytest.importorskip("pieceworks_simgraph.kernels")
    monkeypatch.setattr(platforms, "_current", simgraph_platform.SimGraphPlatform())
    try:
        before = simgraph_kernels.calls["rms_norm"]
        llm = make_llm(checkpoint, compilation)
        tokens = greedy_tokens(llm)
        choice = llm.engine.runner.kernels.chosen_kernels()["rms_norm"]
        assert choice.impl.name == "simgraph_rms_norm"
        assert ("torch", "simgraph_rms_norm ranks higher") in choice.passed_over
        assert simgraph_kernels.calls["rms_norm"] > before  # it ran, eager or in the graph
        assert tokens == cpu_tokens
    finally:
        registry.unregister_kernel("rms_norm", "simgraph_rms_norm")


class SkipsTheBaseHook(CpuPlatform):
    """A vendor whose config hook does its own thing and never calls the base class."""

    name = "skips-base"
    default_compile_backend = "eager"

    def check_and_update_config(self, config: EngineConfig) -> None:
        config.compilation_config.cudagraph_capture_sizes = [1, 2]


def test_declared_defaults_apply_when_the_hook_skips_the_base_class(monkeypatch):
    """The backend comes from ``default_compile_backend`` and graphs go off on a platform
    without them, although the override set neither."""
    monkeypatch.setattr(platforms, "_current", SkipsTheBaseHook())
    config = EngineConfig(compilation_config=CompilationConfig(level=3))
    assert config.compilation_config.backend == "eager"
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert config.compilation_config.cudagraph_capture_sizes == [1, 2]
