"""KV-cache sizing and allocation: how many paged blocks fit, and binding them to the layers.

The runner profiles one forward at the largest token count, then gives the KV cache what is left
of ``gpu_memory_utilization`` after the weights, that peak, and the memory the captured graphs
will take (``estimate_graph_memory``, counted before the cache is sized and compared with the real
footprint after capture). The cache is capped at what ``max_num_seqs`` sequences of
``max_model_len`` tokens could ever use, and at ``kv_cache_memory_bytes`` when set (the CPU
platform sets it by default: there device memory is host RAM).
Sizes are per tensor-parallel rank: each ``Attention`` layer knows its rank's KV heads (a
replicated KV head counts once per rank that holds it).
"""

from __future__ import annotations

import dataclasses

import torch

from pieceworks.config import CUDAGraphMode, EngineConfig
from pieceworks.models.attention.layer import Attention
from pieceworks.models.attention.ops import DecodeWorkspace
from pieceworks.scheduler.block_manager import cdiv

GIB = 1024**3
# Device memory one instantiated graph takes beyond the tensors in the pool (its kernel nodes'
# parameters and the driver's bookkeeping). A round upper figure; the runner logs the estimate
# beside the measured footprint after every capture, which is what to check it against.
GRAPH_OVERHEAD_BYTES = 2 * 1024**2


@dataclasses.dataclass
class KVCacheSpec:
    """Bytes per block over all attention layers (this rank's KV heads), and those layers."""

    layers: list[Attention]
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_layer = [
            2 * self.block_size * layer.num_kv_heads * layer.head_size * element_size
            for layer in self.layers
        ]
        return sum(per_layer)


def attention_layers(config: EngineConfig) -> list[Attention]:
    layers = config.compilation_config.static_forward_context.values()
    return [layer for layer in layers if isinstance(layer, Attention)]


def freeable_sliding_window(config: EngineConfig) -> int | None:
    """The window outside which a request's KV blocks may be freed: the largest layer window when
    every attention layer has one (Mistral); None when a layer attends to the whole context
    (Gemma 3's global layers) or there is no attention layer."""
    windows = [layer.sliding_window for layer in attention_layers(config)]
    if not windows or None in windows:
        return None
    return max(w for w in windows if w is not None)


def max_useful_blocks(config: EngineConfig) -> int:
    """Blocks that max_num_seqs sequences of max_model_len tokens could use at once."""
    max_model_len = config.model_config.max_model_len
    assert max_model_len is not None
    per_seq = cdiv(max_model_len, config.cache_config.block_size)
    return config.scheduler_config.max_num_seqs * per_seq


def num_graphs_to_capture(config: EngineConfig, modes: list[CUDAGraphMode]) -> int:
    """Device graphs the captures of these modes (one per descriptor) will make: one per FULL
    descriptor; one per piece (or breakable segment) per PIECEWISE one, a piece around each of
    the L splitting layers and one more."""
    num_pieces = len(config.compilation_config.static_forward_context) + 1
    return sum(1 if mode == CUDAGraphMode.FULL else num_pieces for mode in modes)


def estimate_graph_memory(
    config: EngineConfig, num_graphs: int, activation_bytes_per_token: float
) -> int:
    """Bytes the captured graphs will hold: the pool keeps the activations of the largest capture
    (every capture shares it and they run largest first, so smaller ones reuse that memory), plus
    ``GRAPH_OVERHEAD_BYTES`` per graph."""
    if num_graphs == 0:
        return 0
    max_capture_size = config.compilation_config.max_capture_size
    if config.speculative_config is not None:  # a verify graph holds S * (1 + k) tokens
        verify_sizes = config.speculative_config.verify_graph_sizes(config)
        max_capture_size = max([max_capture_size, *verify_sizes])
    return int(activation_bytes_per_token * max_capture_size) + num_graphs * GRAPH_OVERHEAD_BYTES


def num_blocks_that_fit(
    config: EngineConfig,
    spec: KVCacheSpec,
    free_bytes: int,
    total_bytes: int,
    used_bytes: int,
    graph_bytes: int = 0,
) -> int:
    """Blocks the memory budget allows, after weights, activations and the graphs' estimate."""
    cache_config = config.cache_config
    if cache_config.num_gpu_blocks_override is not None:
        return cache_config.num_gpu_blocks_override
    if not spec.layers:  # a pure Mamba model: blocks are bookkeeping only and cost no memory
        return max_useful_blocks(config)
    budget = min(free_bytes, int(total_bytes * cache_config.gpu_memory_utilization) - used_bytes)
    budget -= graph_bytes
    if cache_config.kv_cache_memory_bytes is not None:
        budget = min(budget, cache_config.kv_cache_memory_bytes)
    num_blocks = min(max(budget, 0) // spec.bytes_per_block, max_useful_blocks(config))
    max_model_len = config.model_config.max_model_len or 0
    needed = cdiv(max_model_len, cache_config.block_size)
    if num_blocks < needed:
        raise RuntimeError(
            f"the KV cache does not fit: {budget / GIB:.2f} GiB left after the model and its "
            f"activations ({used_bytes / GIB:.2f} GiB) holds {num_blocks} blocks of "
            f"{cache_config.block_size} tokens, but one sequence of max_model_len="
            f"{max_model_len} needs {needed}. Lower --max-model-len or --max-num-batched-tokens, "
            "raise gpu_memory_utilization (or --kv-cache-memory-bytes where it is set), or use a "
            "larger device."
        )
    return num_blocks


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
    """One (2, num_blocks, block_size, Hkv, D) tensor per layer, zeroed, bound to the layer.

    Every layer also gets the same split-KV decode workspace: the layers run one after another
    on one stream, so one scratch serves them all (a few MiB instead of a few per layer).
    """
    workspace = DecodeWorkspace()
    for layer in spec.layers:
        cache = torch.zeros(
            2,
            num_blocks,
            spec.block_size,
            layer.num_kv_heads,
            layer.head_size,
            dtype=spec.dtype,
            device=device,
        )
        layer.bind_kv_cache((cache[0], cache[1]), workspace)
