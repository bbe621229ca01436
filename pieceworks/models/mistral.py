"""Mistral (``MistralForCausalLM``): the Llama layers with sliding-window attention.

HF's Mistral is Llama's decoder with two differences in what it reads: no projection has a bias
(transformers reads neither ``attention_bias`` nor ``mlp_bias`` for Mistral), and every layer
attends only to the last ``sliding_window`` positions, its own included (a query at position p
sees keys p - W + 1 .. p, as ``create_sliding_window_causal_mask`` masks). ``sliding_window``
null is full attention; absent it is 4096, ``MistralConfig``'s default. Because every layer is
sliding, the scheduler frees a request's KV blocks that fall wholly before its window
(``docs/design.md``). ``head_dim`` absent is hidden_size / heads, as for Llama. Everything else
(rotary, GQA, tied or untied embeddings, the compiled backbone) is Llama's.
"""

from __future__ import annotations

from typing import Any

from pieceworks.models.causal_lm import CausalLM
from pieceworks.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel

# MistralConfig's sliding_window where config.json leaves it out (null stays null: no window).
DEFAULT_SLIDING_WINDOW = 4096


def mistral_sliding_window(hf_config: dict[str, Any]) -> int | None:
    """config.json's ``sliding_window``: absent 4096, null None (full attention)."""
    return hf_config.get("sliding_window", DEFAULT_SLIDING_WINDOW)


class MistralAttention(LlamaAttention):
    """Llama's attention without biases, each query seeing the last ``sliding_window`` keys."""

    @staticmethod
    def attention_window(hf_config: dict[str, Any]) -> int | None:
        return mistral_sliding_window(hf_config)

    @staticmethod
    def projection_biases(hf_config: dict[str, Any]) -> tuple[bool, bool]:
        return False, False


class MistralDecoderLayer(LlamaDecoderLayer):
    attention_cls = MistralAttention
    reads_mlp_bias = False


class MistralModel(LlamaModel):
    """Llama's backbone (compiled the same way) over Mistral decoder layers."""

    decoder_layer_cls = MistralDecoderLayer


class MistralForCausalLM(CausalLM):
    """``MistralModel`` plus the LM head and HF-checkpoint loading (``CausalLM``)."""

    model_cls = MistralModel
