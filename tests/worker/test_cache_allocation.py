"""Sizing and allocating the KV cache and the Mamba state cache, on stand-in layers.

Proves: a block's bytes are K and V of every attention layer; the budget is the smaller of the
free memory and ``gpu_memory_utilization`` of the total less what is used and the graphs'
estimate, then ``kv_cache_memory_bytes``, capped at what ``max_num_seqs`` sequences can use, and
a block override wins; a budget too small for one sequence is refused with the whole message;
each layer gets one zeroed ``(2, blocks, block_size, Hkv, D)`` tensor (K and V, nothing more) and
all share one decode workspace. The Mamba cache has ``max_num_seqs + 1`` slots, conv states in
the model dtype and SSM states in float32 or the model dtype, zeroed and bound to each layer, and
a cache that does not fit is refused with its sizes in GiB. No model runs.
Run: pytest tests/worker/test_cache_allocation.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pieceworks.config import EngineConfig
from pieceworks.models.attention.layer import Attention
from pieceworks.models.mamba.mixer import MambaMixer2
from pieceworks.utils import IdentityMemo
from pieceworks.worker.kv_cache import (
    GIB,
    KVCacheSpec,
    allocate_kv_cache,
    attention_layers,
    max_useful_blocks,
    num_blocks_that_fit,
)
from pieceworks.worker.mamba_cache import (
    MambaCacheSpec,
    allocate_mamba_cache,
    mamba_cache_spec,
    mamba_layers,
)


class StandInAttention(Attention):
    def __init__(self, num_kv_heads: int, head_size: int) -> None:
        nn.Module.__init__(self)
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self._plans: dict = {}
        self._last_plan = IdentityMemo()


class StandInMixer(MambaMixer2):
    def __init__(self, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...]) -> None:
        nn.Module.__init__(self)
        self.shapes = (conv_shape, ssm_shape)

    def state_shapes(self):
        return self.shapes


def config_with(layers: dict, max_model_len: int = 64, max_num_seqs: int = 4) -> EngineConfig:
    config = EngineConfig()
    config.compilation_config.static_forward_context.update(layers)
    config.model_config.max_model_len = max_model_len
    config.scheduler_config.max_num_seqs = max_num_seqs
    config.cache_config.kv_cache_memory_bytes = None
    return config


def test_a_block_holds_k_and_v_of_every_attention_layer():
    layers = [StandInAttention(2, 8), StandInAttention(1, 4)]
    assert KVCacheSpec(layers, 16, torch.float32).bytes_per_block == 2 * 16 * (16 + 4) * 4
    assert KVCacheSpec(layers, 16, torch.bfloat16).bytes_per_block == 2 * 16 * (16 + 4) * 2
    config = config_with({"a": layers[0], "m": StandInMixer((2, 3), (1, 2, 3)), "b": layers[1]})
    assert attention_layers(config) == layers
    assert len(mamba_layers(config)) == 1
    assert max_useful_blocks(config_with({}, max_model_len=33, max_num_seqs=3)) == 3 * 3


def test_the_budget_is_the_smallest_limit_and_the_blocks_are_capped():
    layer = StandInAttention(1, 8)
    config = config_with({"a": layer}, max_model_len=64, max_num_seqs=4)  # 16 useful blocks
    spec = KVCacheSpec([layer], 16, torch.float32)
    block = spec.bytes_per_block  # 1024
    big = 10**9
    assert num_blocks_that_fit(config, spec, big, big, 0) == 16  # capped at the useful blocks
    assert num_blocks_that_fit(config, spec, 5 * block + 1, big, 0) == 5  # free memory
    total = int(10 * block / 0.9) + 1  # 90 % of it is 10 blocks
    assert num_blocks_that_fit(config, spec, big, total, 0) == 10
    assert num_blocks_that_fit(config, spec, big, total, 2 * block) == 8  # less what is used
    assert num_blocks_that_fit(config, spec, big, total, 2 * block, block) == 7  # and graphs
    config.cache_config.kv_cache_memory_bytes = 6 * block
    assert num_blocks_that_fit(config, spec, big, big, 0) == 6
    config.cache_config.num_gpu_blocks_override = 3
    assert num_blocks_that_fit(config, spec, 0, 0, 0) == 3
    mamba_only = config_with({"m": StandInMixer((2, 3), (1, 2, 3))}, max_num_seqs=2)
    assert num_blocks_that_fit(mamba_only, KVCacheSpec([], 16, torch.float32), 0, 0, 0) == 8


def test_a_budget_short_of_one_sequence_is_refused_with_the_whole_message():
    layer = StandInAttention(1, 8)
    config = config_with({"a": layer}, max_model_len=64)  # one sequence: 4 blocks
    spec = KVCacheSpec([layer], 16, torch.float32)
    with pytest.raises(RuntimeError) as error:
        num_blocks_that_fit(config, spec, 3 * spec.bytes_per_block, 10**9, GIB // 2)
    assert str(error.value) == (
        "the KV cache does not fit: 0.00 GiB left after the model and its activations "
        "(0.50 GiB) holds 3 blocks of 16 tokens, but one sequence of max_model_len=64 needs 4. "
        "Lower --max-model-len or --max-num-batched-tokens, raise gpu_memory_utilization (or "
        "--kv-cache-memory-bytes where it is set), or use a larger device."
    )
    with pytest.raises(RuntimeError, match="holds 0 blocks"):
        num_blocks_that_fit(config, spec, 10**9, 10**9, 10**9)  # a negative budget holds none


def test_each_layer_gets_zeroed_k_and_v_and_one_shared_workspace():
    layers = [StandInAttention(2, 8), StandInAttention(1, 4)]
    spec = KVCacheSpec(layers, 16, torch.float32)
    allocate_kv_cache(spec, 5, torch.device("cpu"))
    for layer in layers:
        key, value = layer._kv_cache
        assert key.shape == value.shape == (5, 16, layer.num_kv_heads, layer.head_size)
        assert key.dtype == torch.float32
        assert not key.any() and not value.any()
        assert key.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
        assert key.untyped_storage().nbytes() == 2 * key.numel() * 4  # K and V only
        assert value.data_ptr() - key.data_ptr() == key.numel() * 4
    assert layers[0].workspace is layers[1].workspace
    total = sum(layer._kv_cache[0].untyped_storage().nbytes() for layer in layers)
    assert total == 5 * spec.bytes_per_block


def test_the_mamba_cache_has_a_slot_per_sequence_and_the_null_slot():
    mixers = [StandInMixer((6, 3), (2, 4, 5)), StandInMixer((4, 3), (1, 4, 5))]
    config = config_with({"m0": mixers[0], "m1": mixers[1]}, max_num_seqs=3)
    assert mamba_cache_spec(config_with({"a": StandInAttention(1, 8)})) is None
    config.model_config.dtype = torch.bfloat16
    spec = mamba_cache_spec(config)
    assert spec == MambaCacheSpec(mixers, 4, torch.bfloat16, torch.float32)
    assert spec.num_bytes == 4 * ((18 + 12) * 2 + (40 + 20) * 4)
    config.cache_config.mamba_ssm_cache_dtype = "auto"
    assert mamba_cache_spec(config).ssm_dtype == torch.bfloat16
    allocate_mamba_cache(spec, torch.device("cpu"), free_bytes=spec.num_bytes)  # just fits
    for mixer in mixers:
        conv, ssm = mixer.mamba_cache
        assert conv.shape == (4, *mixer.shapes[0]) and conv.dtype == torch.bfloat16
        assert ssm.shape == (4, *mixer.shapes[1]) and ssm.dtype == torch.float32
        assert not conv.any() and not ssm.any()


def test_a_mamba_cache_that_does_not_fit_is_refused_with_its_sizes():
    spec = MambaCacheSpec(
        [StandInMixer((1024, 3), (64, 64, 128))], 50, torch.float32, torch.float32
    )
    assert spec.num_bytes == 50 * (1024 * 3 + 64 * 64 * 128) * 4
    with pytest.raises(RuntimeError) as error:
        allocate_mamba_cache(spec, torch.device("cpu"), free_bytes=GIB // 20)
    assert str(error.value) == (
        "the Mamba state cache does not fit: 50 slots (max_num_seqs + 1) of 1 layers need "
        "0.10 GiB, but 0.05 GiB are free after the weights. Lower max_num_seqs, or set "
        "mamba_ssm_cache_dtype='auto' to keep SSM states in the model dtype."
    )
