"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): the Llama layers with biases on q, k and v.

HF's Qwen2 is Llama's decoder with one difference in the math: ``q_proj``, ``k_proj`` and
``v_proj`` carry a bias and ``o_proj`` does not, whatever ``attention_bias`` says (transformers
reads neither ``attention_bias`` nor ``mlp_bias`` for Qwen2, and the MLP has no bias). So the merged
``qkv_proj`` has a bias, which ``QKVParallelLinear`` loads per shard and splits across
tensor-parallel ranks as it splits the weight. Sliding-window attention (``use_sliding_window``, a
``sliding_attention`` entry in ``layer_types``) is not implemented: ``config_checks`` refuses it.
Everything else (rotary, GQA, tied or untied embeddings, the compiled backbone) is Llama's.
"""

from __future__ import annotations

from typing import Any

from pieceworks.models.causal_lm import CausalLM
from pieceworks.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel


class Qwen2Attention(LlamaAttention):
    """Llama's attention with a bias on the qkv projection and none on the output."""

    @staticmethod
    def projection_biases(hf_config: dict[str, Any]) -> tuple[bool, bool]:
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention
    reads_mlp_bias = False


class Qwen2Model(LlamaModel):
    """Llama's backbone (compiled the same way) over Qwen2 decoder layers."""

    decoder_layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(CausalLM):
    """``Qwen2Model`` plus the LM head and HF-checkpoint loading (``CausalLM``)."""

    model_cls = Qwen2Model
