"""Qwen3 (``Qwen3ForCausalLM``): the Llama layers with an RMSNorm on each query and key head.

HF's Qwen3 attention normalises every head of q and of k (``q_norm``, ``k_norm``: RMSNorm over
``head_dim``, one weight shared by the heads, ``rms_norm_eps``) after the projection and before the
rotary embedding; the rest is Llama's: biases on q, k, v and o only with ``attention_bias``, none
on the MLP (transformers' Qwen3 does not read ``mlp_bias``), ``head_dim`` independent of
``hidden_size`` (absent: 128, the config class's default, see
``config_defaults.ABSENT_FIELD_DEFAULTS``), tied or untied embeddings. Sliding-window attention is
refused by ``config_checks``. With tensor parallelism the head norms are replicated: every rank
normalises its own heads with the whole weight.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pieceworks.config import EngineConfig
from pieceworks.models.causal_lm import CausalLM
from pieceworks.models.layers.layernorm import RMSNorm
from pieceworks.models.layers.rotary_embedding import RotaryEmbedding
from pieceworks.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel


class Qwen3Attention(LlamaAttention):
    """qkv projection -> RMSNorm per q and k head -> rotary -> paged attention -> output.

    ``head_norm_cls`` is the norm of each head (Gemma 3 subclasses this with its ``(1 + w)``
    norm); ``scale`` and ``sliding_window`` go to ``LlamaAttention``."""

    head_norm_cls: ClassVar[type[nn.Module]] = RMSNorm

    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary_emb: RotaryEmbedding,
        *,
        config: EngineConfig,
        prefix: str,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(
            hf_config,
            rotary_emb,
            config=config,
            prefix=prefix,
            scale=scale,
            sliding_window=sliding_window,
        )
        eps = hf_config["rms_norm_eps"]
        self.q_norm = self.head_norm_cls(self.head_dim, eps)
        self.k_norm = self.head_norm_cls(self.head_dim, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, (Hq + 2 * Hkv) * D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Each head on its own row: (T * H, D) normalised over D, then back to (T, H * D).
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)  # (T, Hq * D)
        return self.o_proj(attn_output)  # (T, hidden)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention
    reads_mlp_bias = False


class Qwen3Model(LlamaModel):
    """Llama's backbone (compiled the same way) over Qwen3 decoder layers."""

    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(CausalLM):
    """``Qwen3Model`` plus the LM head and HF-checkpoint loading (``CausalLM``)."""

    model_cls = Qwen3Model
