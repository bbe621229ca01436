"""Model building blocks in plain ATen (so Inductor fuses them), with vLLM's names.

Activations are flattened tokens, ``(num_tokens, hidden_size)`` with no batch dim. Attention and
the Mamba2 mixer are not here: they are opaque custom ops (``models/attention``, ``models/mamba``).
"""

from pieceworks.models.layers.activation import GeluAndMul, SiluAndMul, silu_and_mul
from pieceworks.models.layers.layernorm import GemmaRMSNorm, RMSNorm
from pieceworks.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pieceworks.models.layers.rotary_embedding import RotaryEmbedding, get_rope
from pieceworks.models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear",
    "GeluAndMul",
    "GemmaRMSNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "get_rope",
    "silu_and_mul",
]
