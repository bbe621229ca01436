"""Llama (2, 3, 3.1) for pieceworks: vLLM's module layout over flattened tokens.

``LlamaModel`` is the compiled part (``@support_torch_compile``): ``input_ids (T,)`` and
``positions (T,)`` in, hidden states ``(T, hidden)`` out, with no batch dimension; the only opaque
op inside is attention, where the graph is split. ``LlamaForCausalLM`` adds the LM head, applied in
``compute_logits`` outside the graph, and ``load_weights``, which maps HF checkpoint names onto the
merged ``qkv_proj`` / ``gate_up_proj`` weights. Per-step attention metadata (slot mapping, block
tables) comes from the forward context, never from arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pieceworks.config import EngineConfig, resolve_dtype
from pieceworks.core.decorators import support_torch_compile
from pieceworks.models.attention.layer import Attention
from pieceworks.models.layers.activation import SiluAndMul
from pieceworks.models.layers.layernorm import RMSNorm
from pieceworks.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pieceworks.models.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pieceworks.models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pieceworks.models.loader import get_weight_loader, is_ignored_tensor, unexpected_tensor_error


def maybe_prefix(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the top level (vLLM's helper)."""
    return f"{prefix}.{name}" if prefix else name


def _head_dim(hf_config: dict[str, Any]) -> int:
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


def llama_rope(hf_config: dict[str, Any], dtype: torch.dtype) -> RotaryEmbedding:
    """The rotary embedding a Llama config describes (one per model, shared by its layers)."""
    base, rope_scaling, partial_rotary_factor = get_rope_parameters(hf_config)
    head_dim = _head_dim(hf_config)
    return get_rope(
        head_size=head_dim,
        rotary_dim=int(head_dim * partial_rotary_factor),
        max_position=hf_config.get("max_position_embeddings", 8192),
        base=base,
        rope_scaling=rope_scaling,
        is_neox_style=True,
        dtype=dtype,
    )


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up in one GEMM."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, *, prefix: str = ""
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * I)
        return self.down_proj(self.act_fn(gate_up))  # (T, hidden)


class LlamaAttention(nn.Module):
    """qkv projection -> rotary -> paged attention (custom op) -> output projection."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary_emb: RotaryEmbedding,
        *,
        config: EngineConfig,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden_size = hf_config["hidden_size"]
        self.head_dim = _head_dim(hf_config)
        total_num_heads = hf_config["num_attention_heads"]
        total_num_kv_heads = hf_config.get("num_key_value_heads", total_num_heads)
        bias = hf_config.get("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            total_num_heads,
            total_num_kv_heads,
            bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_dim, hidden_size, bias, prefix=f"{prefix}.o_proj"
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            config=config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, (Hq + 2 * Hkv) * D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)  # (T, Hq * D)
        return self.o_proj(attn_output)  # (T, hidden)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried through the fused add of ``RMSNorm``."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary_emb: RotaryEmbedding,
        *,
        config: EngineConfig,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden_size, eps = hf_config["hidden_size"], hf_config.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(
            hf_config, rotary_emb, config=config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(
            hidden_size,
            hf_config["intermediate_size"],
            hf_config.get("mlp_bias", False),
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual  # (T, hidden) each


@support_torch_compile
class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: the part that is traced, split and captured."""

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            hf_config["vocab_size"],
            hf_config["hidden_size"],
            prefix=maybe_prefix(prefix, "embed_tokens"),
        )
        # One cos/sin cache for all layers (each layer registers the same module).
        dtype = resolve_dtype(config.model_config.dtype, hf_config)  # already a torch.dtype
        rotary_emb = llama_rope(hf_config, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                hf_config, rotary_emb, config=config, prefix=maybe_prefix(prefix, f"layers.{i}")
            )
            for i in range(hf_config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hf_config["hidden_size"], hf_config.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # (T, hidden)


class LlamaForCausalLM(nn.Module):
    """``LlamaModel`` plus the LM head and HF-checkpoint loading."""

    # Merged parameter -> the HF modules stacked into it, in shard order.
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # (param name, checkpoint name, shard id) for the merged weights.
    stacked_params_mapping: list[tuple[str, str, str | int]] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = config.model_config.hf_config
        self.config = config
        self.tie_word_embeddings = hf_config.get("tie_word_embeddings", False)
        self.model = LlamaModel(config=config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            hf_config["vocab_size"],
            hf_config["hidden_size"],
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids (T,)``, ``positions (T,)`` -> hidden states ``(T, hidden)``."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(N, hidden)`` -> float32 logits ``(N, vocab)`` (outside the graph)."""
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the parameter names loaded."""
        params_dict = dict(self.named_parameters())
        loaded_params: set[str] = set()
        for checkpoint_name, loaded_weight in weights:
            if is_ignored_tensor(checkpoint_name):
                continue
            if self.tie_word_embeddings and checkpoint_name == "lm_head.weight":
                continue  # some tied checkpoints still carry it; the embedding is the weight
            name, shard_id = self._param_name_and_shard(checkpoint_name)
            if name not in params_dict:
                raise unexpected_tensor_error(self, checkpoint_name)
            weight_loader = get_weight_loader(self, name)
            shard_args = () if shard_id is None else (shard_id,)
            weight_loader(params_dict[name], loaded_weight, *shard_args)
            loaded_params.add(name)
        return loaded_params

    def _param_name_and_shard(self, checkpoint_name: str) -> tuple[str, str | int | None]:
        """``...self_attn.k_proj.weight`` -> (``...self_attn.qkv_proj.weight``, ``"k"``)."""
        for param_name, weight_name, shard_id in self.stacked_params_mapping:
            if weight_name in checkpoint_name:
                return checkpoint_name.replace(weight_name, param_name), shard_id
        return checkpoint_name, None
