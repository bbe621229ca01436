"""The state-slot cache: one ``(conv_state, ssm_state)`` pair per recurrent layer, bound to it.

A hybrid model's recurrent layers (Mamba2 mixers, and Gated DeltaNet, whose recurrent state
``(Hv, Dk, Dv)`` takes the SSM state's place and dtype) keep a fixed-size state per sequence
instead of a growing KV cache.
The runner allocates ``max_num_seqs + 1`` slots per layer once, before the profiling forward (so
the KV-cache budget measured after it already excludes these bytes); slot 0 is the null slot that
padded rows read and write, and the scheduler's ``StateSlotManager`` hands out the others, one per
running request. Conv states are kept in the model dtype; SSM states in
``CacheConfig.mamba_ssm_cache_dtype`` ("float32", the default, or "auto" = model dtype). Shapes
come from each layer's ``state_shapes()``, which are this tensor-parallel rank's: its Mamba heads
and the conv channels of its ``[x, B, C]`` slice.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from pieceworks.config import EngineConfig
from pieceworks.models.gated_delta_net.mixer import GatedDeltaNet
from pieceworks.models.mamba.mixer import MambaMixer2

# The layers with a fixed-size state per sequence; each has ``state_shapes()`` and ``mamba_cache``.
StateLayer = MambaMixer2 | GatedDeltaNet


@dataclasses.dataclass
class MambaCacheSpec:
    """The Mamba layers, their slot count and the two state dtypes."""

    layers: list[StateLayer]
    num_slots: int  # max_num_seqs + 1: slot 0 is the null slot
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        conv_size = torch.empty((), dtype=self.conv_dtype).element_size()
        ssm_size = torch.empty((), dtype=self.ssm_dtype).element_size()
        per_slot = 0
        for layer in self.layers:
            conv_shape, ssm_shape = layer.state_shapes()
            per_slot += math.prod(conv_shape) * conv_size + math.prod(ssm_shape) * ssm_size
        return self.num_slots * per_slot


def mamba_layers(config: EngineConfig) -> list[StateLayer]:
    """The Mamba2 and Gated DeltaNet layers: each gets a conv state and a recurrent state."""
    layers = config.compilation_config.static_forward_context.values()
    return [layer for layer in layers if isinstance(layer, (MambaMixer2, GatedDeltaNet))]


def mamba_cache_spec(config: EngineConfig) -> MambaCacheSpec | None:
    """The state cache the model needs, or None for a model without Mamba layers."""
    layers = mamba_layers(config)
    if not layers:
        return None
    model_dtype = config.model_config.dtype
    assert isinstance(model_dtype, torch.dtype)  # resolved in ModelConfig.__post_init__
    ssm_dtype = (
        model_dtype if config.cache_config.mamba_ssm_cache_dtype == "auto" else torch.float32
    )
    num_slots = config.scheduler_config.max_num_seqs + 1
    return MambaCacheSpec(layers, num_slots, model_dtype, ssm_dtype)


def allocate_mamba_cache(spec: MambaCacheSpec, device: torch.device, free_bytes: int) -> None:
    """Zeroed conv and SSM states for every slot of every Mamba layer, bound to the layer."""
    if spec.num_bytes > free_bytes:
        raise RuntimeError(
            f"the Mamba state cache does not fit: {spec.num_slots} slots (max_num_seqs + 1) of "
            f"{len(spec.layers)} layers need {spec.num_bytes / 1024**3:.2f} GiB, but "
            f"{free_bytes / 1024**3:.2f} GiB are free after the weights. Lower max_num_seqs, or "
            "set mamba_ssm_cache_dtype='auto' to keep SSM states in the model dtype."
        )
    for layer in spec.layers:
        conv_shape, ssm_shape = layer.state_shapes()
        conv_state = torch.zeros(
            (spec.num_slots, *conv_shape), dtype=spec.conv_dtype, device=device
        )
        ssm_state = torch.zeros((spec.num_slots, *ssm_shape), dtype=spec.ssm_dtype, device=device)
        layer.mamba_cache = (conv_state, ssm_state)
