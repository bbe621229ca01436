"""Bamba (IBM's Mamba2 + attention hybrid) for pieceworks, over flattened tokens like Llama.

``BambaModel`` is the compiled part (``@support_torch_compile``): layers listed in
``attn_layer_indices`` are Llama-style attention with partial rotary (``partial_rotary_factor``,
0.5 by default: half of each head, neox style), the others are ``MambaMixer2``; every layer then
runs the SwiGLU MLP, each sub-block behind its own RMSNorm (``input_layernorm``,
``pre_ff_layernorm``), and ``final_layernorm`` closes the stack. The graph is split at both opaque
ops, attention and ``mamba_mixer2``. ``BambaForCausalLM`` adds the LM head (``compute_logits``,
outside the graph) and ``load_weights`` from HF names (``layers.N.mamba.*``,
``layers.N.self_attn.{q,k,v,o}_proj``, ``layers.N.feed_forward.{gate,up,down}_proj``). Tensor
parallelism shards attention and the MLP as in Llama and the mixers by Mamba heads (see
``mamba/sharding.py``): ``mamba_n_heads`` must be divisible by the tensor-parallel size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pieceworks.config import EngineConfig, resolve_dtype
from pieceworks.core.decorators import support_torch_compile
from pieceworks.models.causal_lm import CausalLM, maybe_prefix
from pieceworks.models.layers.layernorm import RMSNorm
from pieceworks.models.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pieceworks.models.layers.vocab_embedding import VocabParallelEmbedding
from pieceworks.models.llama import LlamaAttention, LlamaMLP
from pieceworks.models.loading.config_defaults import with_architecture_defaults
from pieceworks.models.mamba.mixer import MambaMixer2

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # HF's BambaConfig hard-codes this value


def partial_rotary_factor(hf_config: dict[str, Any]) -> float:
    """``partial_rotary_factor`` from ``rope_parameters`` or the top level, else Bamba's 0.5."""
    for source in (hf_config.get("rope_parameters") or {}, hf_config):
        if source.get("partial_rotary_factor") is not None:
            return float(source["partial_rotary_factor"])
    return DEFAULT_PARTIAL_ROTARY_FACTOR


def bamba_rope(hf_config: dict[str, Any], dtype: torch.dtype) -> RotaryEmbedding:
    """The rotary embedding of the attention layers: neox style on the first rotary_dim dims."""
    base, rope_scaling, _ = get_rope_parameters(hf_config)
    head_dim = hf_config.get("head_dim") or (
        hf_config["hidden_size"] // hf_config["num_attention_heads"]
    )
    return get_rope(
        head_size=head_dim,
        rotary_dim=int(head_dim * partial_rotary_factor(hf_config)),
        max_position=hf_config["max_position_embeddings"],
        base=base,
        rope_scaling=rope_scaling,
        is_neox_style=True,
        dtype=dtype,
    )


class BambaDecoderLayer(nn.Module):
    """Mixer (Mamba2 or attention) then MLP, pre-norm; the residual rides the fused RMSNorm add."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary_emb: RotaryEmbedding,
        is_attention: bool,
        *,
        config: EngineConfig,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden_size, eps = hf_config["hidden_size"], hf_config["rms_norm_eps"]
        self.is_attention = is_attention
        if is_attention:
            self.self_attn = LlamaAttention(
                hf_config, rotary_emb, config=config, prefix=f"{prefix}.self_attn"
            )
        else:
            self.mamba = MambaMixer2(hf_config, config=config, prefix=f"{prefix}.mamba")
        self.feed_forward = LlamaMLP(
            hidden_size,
            hf_config["intermediate_size"],
            hf_config["mlp_bias"],
            prefix=f"{prefix}.feed_forward",
        )
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.pre_ff_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.is_attention:
            hidden_states = self.self_attn(positions, hidden_states)
        else:
            hidden_states = self.mamba(hidden_states)
        hidden_states, residual = self.pre_ff_layernorm(hidden_states, residual)
        return self.feed_forward(hidden_states), residual  # (T, hidden) each


@support_torch_compile
class BambaModel(nn.Module):
    """Embedding, hybrid decoder layers and final norm: the part that is traced, split, captured."""

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = with_architecture_defaults(config.model_config.hf_config)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            hf_config["vocab_size"],
            hf_config["hidden_size"],
            prefix=maybe_prefix(prefix, "embed_tokens"),
        )
        dtype = resolve_dtype(config.model_config.dtype, hf_config)
        rotary_emb = bamba_rope(hf_config, dtype)  # one cos/sin cache, shared
        attention_layers = set(hf_config.get("attn_layer_indices") or [])
        self.layers = nn.ModuleList(
            BambaDecoderLayer(
                hf_config,
                rotary_emb,
                i in attention_layers,
                config=config,
                prefix=maybe_prefix(prefix, f"layers.{i}"),
            )
            for i in range(hf_config["num_hidden_layers"])
        )
        self.final_layernorm = RMSNorm(hf_config["hidden_size"], hf_config["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.final_layernorm(hidden_states, residual)
        return hidden_states  # (T, hidden)


class BambaForCausalLM(CausalLM):
    """``BambaModel`` plus the LM head and HF-checkpoint loading (``CausalLM``)."""

    model_cls = BambaModel
