"""Nemotron-H (NVIDIA's Mamba2 + attention + MLP hybrid) for pieceworks, over flattened tokens.

``NemotronHModel`` is the compiled part (``@support_torch_compile``). Each layer is one pre-norm
block, ``x + mixer(norm(x))``, whose mixer is the layer's type (``nemotron_h_layer_types``:
``layers_block_type`` or the older ``hybrid_override_pattern``): a Mamba2 mixer (``M``,
``"linear_attention"``: Bamba's ``MambaMixer2``, the same math: gate before the per-group norm,
``time_step_limit``, conv bias ``use_conv_bias``, projection biases ``use_bias``), attention
(``*``: no rotary embedding at all, no projection biases) or an MLP (``-``:
``down_proj(relu2(up_proj(x)))``, biases ``mlp_bias``). MoE layers (``E``) are refused by the
config check. ``norm_f`` closes the stack. The graph is split at attention and ``mamba_mixer2``.
``NemotronHForCausalLM`` adds the LM head and loads HF names (``backbone.embeddings``,
``backbone.layers.N.norm``, ``backbone.layers.N.mixer.*``, ``backbone.norm_f``, or ``model.`` for
``backbone.``) through ``map_checkpoint_name``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pieceworks.config import EngineConfig
from pieceworks.core.decorators import support_torch_compile
from pieceworks.models.causal_lm import CausalLM, maybe_prefix
from pieceworks.models.layers.activation import ReLUSquared
from pieceworks.models.layers.layernorm import RMSNorm
from pieceworks.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from pieceworks.models.layers.vocab_embedding import VocabParallelEmbedding
from pieceworks.models.llama import LlamaAttention
from pieceworks.models.loading.config_defaults import with_architecture_defaults
from pieceworks.models.loading.nemotron_h_config import (
    nemotron_h_layer_types,
    nemotron_h_mamba_fields,
)
from pieceworks.models.mamba.mixer import MambaMixer2


class NemotronHMLP(nn.Module):
    """``down_proj(relu2(up_proj(x)))``: no gate."""

    def __init__(self, hf_config: dict[str, Any], *, prefix: str) -> None:
        super().__init__()
        hidden_size, intermediate_size = hf_config["hidden_size"], hf_config["intermediate_size"]
        bias = bool(hf_config["mlp_bias"])
        self.up_proj = ColumnParallelLinear(
            hidden_size, intermediate_size, bias, prefix=f"{prefix}.up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = ReLUSquared()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))  # (T, hidden)


class NemotronHAttention(LlamaAttention):
    """Llama's attention without rotary embedding and without projection biases."""

    def __init__(self, hf_config: dict[str, Any], *, config: EngineConfig, prefix: str) -> None:
        super().__init__(hf_config, None, config=config, prefix=prefix)  # type: ignore[arg-type]

    @staticmethod
    def projection_biases(hf_config: dict[str, Any]) -> tuple[bool, bool]:
        return False, False  # HF's NemotronHAttention does not read attention_bias

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, (Hq + 2 * Hkv) * D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v))  # (T, hidden)


class NemotronHDecoderLayer(nn.Module):
    """``x + mixer(norm(x))``; the residual rides the fused RMSNorm add."""

    def __init__(
        self, hf_config: dict[str, Any], layer_type: str, *, config: EngineConfig, prefix: str
    ) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.norm = RMSNorm(hf_config["hidden_size"], hf_config["layer_norm_epsilon"])
        mixer_prefix = f"{prefix}.mixer"
        self.mixer: nn.Module
        if layer_type == "linear_attention":
            mamba_fields = nemotron_h_mamba_fields(hf_config)
            self.mixer = MambaMixer2(mamba_fields, config=config, prefix=mixer_prefix)
        elif layer_type == "full_attention":
            self.mixer = NemotronHAttention(hf_config, config=config, prefix=mixer_prefix)
        elif layer_type == "mlp":
            self.mixer = NemotronHMLP(hf_config, prefix=mixer_prefix)
        else:
            raise ValueError(f"{prefix}: Nemotron-H layer type {layer_type!r} is not supported")

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.norm(hidden_states)
        else:
            hidden_states, residual = self.norm(hidden_states, residual)
        if self.layer_type == "full_attention":
            return self.mixer(positions, hidden_states), residual
        return self.mixer(hidden_states), residual  # (T, hidden) each


@support_torch_compile
class NemotronHModel(nn.Module):
    """Embedding, the hybrid blocks and ``norm_f``: the part that is traced, split, captured."""

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = with_architecture_defaults(config.model_config.hf_config)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            hf_config["vocab_size"],
            hf_config["hidden_size"],
            prefix=maybe_prefix(prefix, "embed_tokens"),
        )
        self.layers = nn.ModuleList(
            NemotronHDecoderLayer(
                hf_config, layer_type, config=config, prefix=maybe_prefix(prefix, f"layers.{i}")
            )
            for i, layer_type in enumerate(nemotron_h_layer_types(hf_config))
        )
        self.norm_f = RMSNorm(hf_config["hidden_size"], hf_config["layer_norm_epsilon"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm_f(hidden_states, residual)
        return hidden_states  # (T, hidden)


class NemotronHForCausalLM(CausalLM):
    """``NemotronHModel`` plus the LM head and HF-checkpoint loading (``CausalLM``)."""

    model_cls = NemotronHModel
    # Only q, k and v are merged: the MLP's up_proj stays a weight of its own.
    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    ]

    @staticmethod
    def map_checkpoint_name(checkpoint_name: str) -> str:
        """HF's names onto this model's: ``backbone.`` (how transformers saves it, and the older
        checkpoints) is ``model.``, and ``embeddings`` is ``embed_tokens``."""
        if checkpoint_name.startswith("backbone."):
            checkpoint_name = "model." + checkpoint_name.removeprefix("backbone.")
        return checkpoint_name.replace("model.embeddings.", "model.embed_tokens.", 1)
