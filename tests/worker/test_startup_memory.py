"""Start-up memory and capture order: graph memory counted before the KV cache is sized, the CPU
KV cache capped, every warm-up before the first capture, running out of memory in capture a clear
error naming the settings to lower. Graph runs use the simgraph example platform (llama-tiny,
eager backend). Run: pytest tests/worker/test_startup_memory.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.config import CacheConfig, EngineConfig
from pieceworks.core.config import CUDAGraphMode
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import random_hf_checkpoint
from pieceworks.platforms.cpu import DEFAULT_KV_CACHE_MEMORY_BYTES, CpuPlatform
from pieceworks.worker.graph_capture import GraphCapture
from pieceworks.worker.kv_cache import (
    GRAPH_OVERHEAD_BYTES,
    KVCacheSpec,
    attention_layers,
    estimate_graph_memory,
    num_graphs_to_capture,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama-tiny")
    random_hf_checkpoint("llama-tiny", path, seed=3, dtype=torch.float32)
    return str(path)


def graph_engine(checkpoint: str, **engine_args) -> LLM:
    compilation = compilation_for_mode("full_and_piecewise", {"backend": "eager"})
    return LLM(checkpoint, compilation_config=compilation, dtype="float32", max_num_seqs=4,
               **engine_args)  # fmt: skip


def test_graph_count_is_one_per_full_descriptor_and_one_per_piece():
    config = EngineConfig()
    config.compilation_config.static_forward_context.update({"layer_0": None, "layer_1": None})
    modes = [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE]
    assert num_graphs_to_capture(config, modes) == 1 + 2 * (2 + 1)  # 2 splitting layers: 3 pieces


def test_graph_estimate_is_the_largest_capture_plus_overhead_per_graph():
    config = EngineConfig()
    max_capture_size = config.compilation_config.max_capture_size
    assert estimate_graph_memory(config, 0, 1000.0) == 0  # no graphs, nothing held back
    expected = 1000 * max_capture_size + 7 * GRAPH_OVERHEAD_BYTES
    assert estimate_graph_memory(config, 7, 1000.0) == expected


def test_cpu_caps_the_kv_cache_by_default_and_keeps_an_explicit_size():
    config = EngineConfig()
    CpuPlatform().check_and_update_config(config)
    assert config.cache_config.kv_cache_memory_bytes == DEFAULT_KV_CACHE_MEMORY_BYTES
    explicit = EngineConfig(cache_config=CacheConfig(kv_cache_memory_bytes=2**20))
    CpuPlatform().check_and_update_config(explicit)
    assert explicit.cache_config.kv_cache_memory_bytes == 2**20


def test_kv_cache_memory_bytes_limits_the_blocks(checkpoint):
    def engine(**engine_args) -> LLM:
        return LLM(checkpoint, compilation_config={"backend": "eager"}, dtype="float32",
                   max_num_seqs=4, max_model_len=128, **engine_args)  # fmt: skip

    unlimited = engine().engine.runner  # 4 sequences of 128 tokens: 4 * 8 blocks
    assert unlimited.num_blocks == 32
    spec = KVCacheSpec(attention_layers(unlimited.config), 16, torch.float32)
    capped = engine(kv_cache_memory_bytes=10 * spec.bytes_per_block + 1).engine.runner
    assert capped.num_blocks == 10


def test_bad_kv_cache_memory_bytes_is_refused():
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=0 must be a positive"):
        CacheConfig(kv_cache_memory_bytes=0)


def test_graph_memory_is_estimated_before_sizing(checkpoint, graph_platform):
    runner = graph_engine(checkpoint).engine.runner
    # Capture sizes 1, 2, 4, 8: FULL graphs for 1, 2, 4 and PIECEWISE for all four sizes, of
    # llama-tiny's 2 + 1 capturable pieces: 3 + 4 * 3 graphs.
    num_graphs = 3 + 4 * 3
    assert runner.graphs.graph_memory_estimate_bytes >= num_graphs * GRAPH_OVERHEAD_BYTES
    assert runner.graphs.warmup_seconds > 0 and runner.graphs.capture_seconds > 0


def test_every_warm_up_runs_before_the_first_capture(checkpoint, graph_platform, monkeypatch):
    modes: list[CUDAGraphMode] = []
    dummy_forward = GraphCapture.dummy_forward

    def recording(self, num_tokens, mode=CUDAGraphMode.NONE, descriptor=None):
        if descriptor is not None:
            modes.append(mode)
        return dummy_forward(self, num_tokens, mode, descriptor)

    monkeypatch.setattr(GraphCapture, "dummy_forward", recording)
    graph_engine(checkpoint)
    first_capture = next(i for i, mode in enumerate(modes) if mode != CUDAGraphMode.NONE)
    assert first_capture == 7  # one warm-up per shape: 3 uniform decode + 4 mixed
    assert CUDAGraphMode.NONE not in modes[first_capture:]


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("simulated: the allocator is out of memory"),
     RuntimeError("CUDA error: out of memory (simulated: instantiating a graph)")],
)  # fmt: skip
def test_out_of_memory_in_capture_names_the_settings(
    checkpoint, graph_platform, monkeypatch, error
):
    dummy_forward = GraphCapture.dummy_forward

    def out_of_memory_in_capture(self, num_tokens, mode=CUDAGraphMode.NONE, descriptor=None):
        if mode != CUDAGraphMode.NONE:
            raise error
        return dummy_forward(self, num_tokens, mode, descriptor)

    monkeypatch.setattr(GraphCapture, "dummy_forward", out_of_memory_in_capture)
    with pytest.raises(RuntimeError, match="while capturing") as raised:
        graph_engine(checkpoint)
    message = str(raised.value)
    assert "gpu_memory_utilization (now 0.9)" in message
    assert "max_num_seqs, now 4" in message and "cudagraph_capture_sizes" in message
    assert message.endswith("or run without graphs (cudagraph_mode=NONE).")


def test_other_errors_in_capture_are_not_called_out_of_memory(
    checkpoint, graph_platform, monkeypatch
):
    dummy_forward = GraphCapture.dummy_forward

    def failing_capture(self, num_tokens, mode=CUDAGraphMode.NONE, descriptor=None):
        if mode != CUDAGraphMode.NONE:
            raise RuntimeError("simulated: an unrelated capture failure")
        return dummy_forward(self, num_tokens, mode, descriptor)

    monkeypatch.setattr(GraphCapture, "dummy_forward", failing_capture)
    with pytest.raises(RuntimeError, match="an unrelated capture failure"):
        graph_engine(checkpoint)
