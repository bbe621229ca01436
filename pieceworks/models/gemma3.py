"""Gemma 3 text (``Gemma3ForCausalLM``): sliding-window and global layers, Gemma's norms, GeGLU.

Built from the Llama layers, with what transformers' ``modeling_gemma3.py`` does differently:

- each layer is ``layer_types[i]``: ``sliding_attention`` layers attend to the last
  ``sliding_window`` positions (``Attention(sliding_window=...)``) and rotate with their own
  rotary base (``rope_parameters["sliding_attention"]``, 10000 by default), ``full_attention``
  layers see the whole context with theirs (1e6 by default, with the config's linear scaling);
  one cos/sin cache per layer type, shared by its layers;
- every norm is ``GemmaRMSNorm`` (``(1 + weight) * x / rms(x)``, in float32); q and k are
  normalised per head (over ``head_dim``) before the rotary, as in Qwen3;
- the block is sandwiched: ``input_layernorm -> attention -> post_attention_layernorm``, the
  residual add, ``pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm``, the residual
  add (``GemmaRMSNorm``'s fused form carries the residual stream);
- the MLP is GeGLU: ``down(gelu(gate) * up)`` with ``hidden_activation`` (``gelu_pytorch_tanh``,
  the tanh approximation, or ``gelu``) through ``GeluAndMul``;
- embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype (as transformers
  casts its ``embed_scale``); the attention scale is ``query_pre_attn_scalar ** -0.5``;
- ``final_logit_softcapping``, where set, caps the logits: ``tanh(logits / cap) * cap``, in
  ``compute_logits``, outside the graph.

``attn_logit_softcapping`` and ``use_bidirectional_attention`` are refused by ``config_checks``;
the absent fields take ``Gemma3TextConfig``'s values, and older config.json files' rope and layer
pattern keys are read as transformers reads them (``config_defaults``). With tensor parallelism
the head norms are replicated, as in Qwen3.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pieceworks.config import EngineConfig, resolve_dtype
from pieceworks.core.decorators import support_torch_compile
from pieceworks.models.causal_lm import CausalLM, maybe_prefix
from pieceworks.models.layers.activation import HF_GELU_APPROXIMATE, GeluAndMul
from pieceworks.models.layers.layernorm import GemmaRMSNorm
from pieceworks.models.layers.quantization import Fp8Config, get_quant_config
from pieceworks.models.layers.rotary_embedding import RotaryEmbedding, get_rope
from pieceworks.models.layers.vocab_embedding import VocabParallelEmbedding
from pieceworks.models.llama import LlamaMLP, _head_dim
from pieceworks.models.loading.config_defaults import with_architecture_defaults
from pieceworks.models.qwen3 import Qwen3Attention

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_ropes(hf_config: dict[str, Any], dtype: torch.dtype) -> dict[str, RotaryEmbedding]:
    """One rotary embedding per layer type, each with its base and scaling."""
    head_dim = _head_dim(hf_config)
    ropes = {}
    for layer_type, params in hf_config["rope_parameters"].items():
        params = dict(params)
        base = params.pop("rope_theta")
        rope_type = params.get("rope_type", params.get("type", "default"))
        ropes[layer_type] = get_rope(
            head_size=head_dim,
            rotary_dim=head_dim,
            max_position=hf_config["max_position_embeddings"],
            base=float(base),
            rope_scaling=params if rope_type != "default" else None,
            is_neox_style=True,
            dtype=dtype,
        )
    return ropes


class Gemma3MLP(LlamaMLP):
    """``down(gelu(gate(x)) * up(x))`` with gate and up in one GEMM (no biases)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_activation: str,
        *,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        super().__init__(
            hidden_size, intermediate_size, False, prefix=prefix, quant_config=quant_config
        )
        self.act_fn = GeluAndMul(HF_GELU_APPROXIMATE[hidden_activation])  # type: ignore[assignment]


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (q/k head norms before the rotary) with Gemma's ``(1 + w)`` head norms,
    the ``query_pre_attn_scalar ** -0.5`` scale and this layer's own rotary and window (sliding
    layers: ``sliding_window``; global ones: None)."""

    head_norm_cls = GemmaRMSNorm

    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        *,
        config: EngineConfig,
        prefix: str,
    ) -> None:
        super().__init__(
            hf_config,
            rotary_emb,
            config=config,
            prefix=prefix,
            scale=hf_config["query_pre_attn_scalar"] ** -0.5,
            sliding_window=sliding_window,
        )


class Gemma3DecoderLayer(nn.Module):
    """Norms before and after attention and MLP; the residual stream is carried through the
    fused add of ``GemmaRMSNorm`` (``input_layernorm`` and ``pre_feedforward_layernorm``)."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        *,
        config: EngineConfig,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden_size, eps = hf_config["hidden_size"], hf_config["rms_norm_eps"]
        self.self_attn = Gemma3Attention(
            hf_config, rotary_emb, sliding_window, config=config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = Gemma3MLP(
            hidden_size,
            hf_config["intermediate_size"],
            hf_config["hidden_activation"],
            prefix=f"{prefix}.mlp",
            quant_config=get_quant_config(config.model_config),
        )
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return self.post_feedforward_layernorm(hidden_states), residual  # (T, hidden) each


@support_torch_compile
class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers and final norm: the part that is traced, split and
    captured."""

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = with_architecture_defaults(config.model_config.hf_config)
        self.config = config
        hidden_size = hf_config["hidden_size"]
        self.embed_tokens = VocabParallelEmbedding(
            hf_config["vocab_size"], hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
        )
        dtype = resolve_dtype(config.model_config.dtype, hf_config)  # already a torch.dtype
        # transformers keeps sqrt(hidden_size) as a float32 tensor and casts it to the dtype
        scale = torch.tensor(hidden_size**0.5, dtype=torch.float32, device="cpu")
        self.embed_scale = scale.to(dtype).item()  # a constant of the graph
        ropes = gemma3_ropes(hf_config, dtype)
        window = hf_config["sliding_window"]
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                hf_config,
                ropes[layer_type],
                window if layer_type == SLIDING else None,
                config=config,
                prefix=maybe_prefix(prefix, f"layers.{i}"),
            )
            for i, layer_type in enumerate(hf_config["layer_types"])
        )
        self.norm = GemmaRMSNorm(hidden_size, hf_config["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # (T, hidden)


class Gemma3ForCausalLM(CausalLM):
    """``Gemma3Model`` plus the (tied) LM head, the final logit soft-capping and HF-checkpoint
    loading (``CausalLM``)."""

    model_cls = Gemma3Model

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        self.final_logit_softcapping: float | None = config.model_config.hf_config.get(
            "final_logit_softcapping"
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``CausalLM.compute_logits``, then ``tanh(logits / cap) * cap`` where the config sets
        ``final_logit_softcapping``: ``(N, vocab)``."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
