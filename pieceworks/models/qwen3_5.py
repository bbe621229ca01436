"""Qwen3.5 text (``Qwen3_5ForCausalLM``): Gated DeltaNet layers around gated attention.

``Qwen3_5Model`` is the compiled part (``@support_torch_compile``). ``layer_types`` says each
layer's token mixer: ``"linear_attention"`` is ``GatedDeltaNet`` (``models/gated_delta_net``),
``"full_attention"`` is attention with an output gate (``q_proj`` gives each head's query and its
gate side by side; ``o_proj(attn * sigmoid(gate))``), zero-centred RMSNorms on each q and k head,
and the rotary embedding on the first ``partial_rotary_factor`` of each head (neox style; 0.25
when config.json gives none, as transformers' ``Qwen3_5TextConfig``); text positions make the
multimodal rotary sections (``mrope_section``) one ordinary rotary embedding. Every layer then
runs the SwiGLU MLP (no biases); all norms are ``GemmaRMSNorm`` (``1 + weight``, as Gemma's).
The graph is split at attention and ``gated_delta_net``. ``Qwen3_5ForCausalLM`` adds the LM
head and loads HF names, also from a checkpoint with a vision tower (``model.language_model.*`` is
read as ``model.*``; ``model.visual.*`` and the multi-token-prediction ``mtp.*`` are skipped, with
one log line). Tensor parallelism is not implemented (the Gated DeltaNet layer refuses it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from pieceworks.config import EngineConfig, resolve_dtype
from pieceworks.core.decorators import support_torch_compile
from pieceworks.logger import init_logger
from pieceworks.models.attention.layer import Attention
from pieceworks.models.causal_lm import CausalLM, maybe_prefix
from pieceworks.models.gated_delta_net.mixer import GatedDeltaNet
from pieceworks.models.layers.layernorm import GemmaRMSNorm
from pieceworks.models.layers.linear import QKVParallelLinear, RowParallelLinear
from pieceworks.models.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pieceworks.models.layers.vocab_embedding import VocabParallelEmbedding
from pieceworks.models.llama import LlamaMLP
from pieceworks.models.loading.config_defaults import with_architecture_defaults

logger = init_logger(__name__)

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3_5TextConfig's, when config.json gives none
SKIPPED_PREFIXES = ("model.visual.", "mtp.")  # the vision tower, multi-token prediction


def qwen3_5_rope(hf_config: dict[str, Any], dtype: torch.dtype) -> RotaryEmbedding:
    """Neox rotary on the first ``partial_rotary_factor`` of each head (0.25 when absent)."""
    base, rope_scaling, _ = get_rope_parameters(hf_config)
    given = (hf_config.get("rope_parameters") or {}).get("partial_rotary_factor")
    given = hf_config.get("partial_rotary_factor") if given is None else given
    partial = DEFAULT_PARTIAL_ROTARY_FACTOR if given is None else float(given)
    head_dim = hf_config["head_dim"]
    return get_rope(
        head_size=head_dim,
        rotary_dim=int(head_dim * partial),
        max_position=hf_config["max_position_embeddings"],
        base=base,
        rope_scaling=rope_scaling,
        is_neox_style=True,
        dtype=dtype,
    )


class Qwen3_5Attention(nn.Module):
    """q (and its gate), k, v -> q/k head norms -> rotary -> attention * sigmoid(gate) -> o."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary_emb: RotaryEmbedding,
        *,
        config: EngineConfig,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden_size, bias = hf_config["hidden_size"], bool(hf_config["attention_bias"])
        self.head_dim = head_dim = hf_config["head_dim"]
        self.num_heads = hf_config["num_attention_heads"]
        self.num_kv_heads = hf_config["num_key_value_heads"]
        # q_proj is 2 * heads wide (each head's query, then its gate): twice the query heads.
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, 2 * self.num_heads, self.num_kv_heads, bias,
            prefix=f"{prefix}.qkv_proj",
        )  # fmt: skip
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(self.q_size, hidden_size, bias, prefix=f"{prefix}.o_proj")
        eps = hf_config["rms_norm_eps"]
        self.q_norm = GemmaRMSNorm(head_dim, eps)
        self.k_norm = GemmaRMSNorm(head_dim, eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            head_dim,
            head_dim**-0.5,
            self.num_kv_heads,
            config=config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, (2 Hq + 2 Hkv) * D)
        q_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        q = self.q_norm(q).flatten(-2)  # (T, Hq * D), each head normalised over D
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v) * torch.sigmoid(gate.flatten(-2))  # (T, Hq * D)
        return self.o_proj(attn_output)  # (T, hidden)


class Qwen3_5DecoderLayer(nn.Module):
    """Token mixer (Gated DeltaNet or gated attention) then MLP, pre-norm, fused residual add."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        layer_type: str,
        rotary_emb: RotaryEmbedding,
        *,
        config: EngineConfig,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden_size, eps = hf_config["hidden_size"], hf_config["rms_norm_eps"]
        self.is_attention = layer_type == "full_attention"
        if self.is_attention:
            self.self_attn = Qwen3_5Attention(
                hf_config, rotary_emb, config=config, prefix=f"{prefix}.self_attn"
            )
        else:
            self.linear_attn = GatedDeltaNet(
                hf_config, config=config, prefix=f"{prefix}.linear_attn"
            )
        self.mlp = LlamaMLP(hidden_size, hf_config["intermediate_size"], prefix=f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)

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
            hidden_states = self.linear_attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual  # (T, hidden) each


@support_torch_compile
class Qwen3_5Model(nn.Module):
    """Embedding, the hybrid decoder layers and the final norm: traced, split, captured."""

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = with_architecture_defaults(config.model_config.hf_config)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            hf_config["vocab_size"],
            hf_config["hidden_size"],
            prefix=maybe_prefix(prefix, "embed_tokens"),
        )
        rotary_emb = qwen3_5_rope(hf_config, resolve_dtype(config.model_config.dtype, hf_config))
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(
                hf_config,
                layer_type,
                rotary_emb,
                config=config,
                prefix=maybe_prefix(prefix, f"layers.{i}"),
            )
            for i, layer_type in enumerate(hf_config["layer_types"])
        )
        self.norm = GemmaRMSNorm(hf_config["hidden_size"], hf_config["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # (T, hidden)


class Qwen3_5ForCausalLM(CausalLM):
    """``Qwen3_5Model`` plus the LM head and HF-checkpoint loading (``CausalLM``)."""

    model_cls = Qwen3_5Model
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        **CausalLM.packed_modules_mapping,
        "in_proj": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"],
    }
    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = [
        *CausalLM.stacked_params_mapping,
        (".in_proj", ".in_proj_qkv", 0),
        (".in_proj", ".in_proj_z", 1),
        (".in_proj", ".in_proj_b", 2),
        (".in_proj", ".in_proj_a", 3),
    ]

    @staticmethod
    def map_checkpoint_name(checkpoint_name: str) -> str:
        """A checkpoint with a vision tower keeps the text model under ``model.language_model``."""
        return checkpoint_name.replace("model.language_model.", "model.", 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names; the vision tower's and multi-token prediction's tensors are skipped."""
        skipped: list[str] = []

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(SKIPPED_PREFIXES):
                    skipped.append(name)
                else:
                    yield name, tensor

        loaded = super().load_weights(text_weights())
        if skipped:
            logger.info(
                "skipped %d checkpoint tensors of the vision tower and multi-token prediction "
                "(%s): pieceworks serves the text model",
                len(skipped),
                ", ".join(
                    sorted({name.split(".")[0] + "." + name.split(".")[1] for name in skipped})
                ),
            )
        return loaded
