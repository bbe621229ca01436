"""Llama (2, 3, 3.1) for pieceworks: vLLM's module layout over flattened tokens.

``LlamaModel`` is the compiled part (``@support_torch_compile``): ``input_ids (T,)`` and
``positions (T,)`` in, hidden states ``(T, hidden)`` out, with no batch dimension; the only opaque
op inside is attention, where the graph is split. ``LlamaForCausalLM`` adds the LM head, applied in
``compute_logits`` outside the graph, and ``load_weights``, which maps HF checkpoint names onto the
merged ``qkv_proj`` / ``gate_up_proj`` weights. With ``quantization="fp8"`` the four linear layers
of each decoder layer are FP8 (``layers/quantization/fp8.py``); embeddings, norms and the LM head
stay in the model dtype. The layers are plain: ``gate_up_proj -> act_fn -> down_proj``,
``q, k = rotary_emb(positions, q, k)`` and ``o_proj(attn(q, k, v))``; the fused GEMV epilogues
and the attention writing FP8 for ``o_proj`` are compile passes (``core/passes/gemv_fusion.py``,
``core/passes/attn_quant_fusion.py``). Per-step attention
metadata (slot mapping, block tables) comes from the forward context, never from arguments.
With tensor parallelism each rank holds ``num_attention_heads / tp`` query heads,
``max(1, num_key_value_heads / tp)`` KV heads and ``intermediate_size / tp`` MLP columns;
``o_proj`` and ``down_proj`` all-reduce their outputs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pieceworks.config import EngineConfig, resolve_dtype
from pieceworks.core.decorators import support_torch_compile
from pieceworks.models.attention.layer import Attention
from pieceworks.models.causal_lm import CausalLM, maybe_prefix
from pieceworks.models.layers.activation import SiluAndMul
from pieceworks.models.layers.layernorm import RMSNorm
from pieceworks.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
    tensor_parallel_rank_and_size,
)
from pieceworks.models.layers.quantization import Fp8Config, get_quant_config
from pieceworks.models.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pieceworks.models.layers.vocab_embedding import VocabParallelEmbedding
from pieceworks.models.loading.config_defaults import with_architecture_defaults


def _head_dim(hf_config: dict[str, Any]) -> int:
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


def llama_rope(hf_config: dict[str, Any], dtype: torch.dtype) -> RotaryEmbedding:
    """The rotary embedding a Llama config describes (one per model, shared by its layers)."""
    base, rope_scaling, partial_rotary_factor = get_rope_parameters(hf_config)
    head_dim = _head_dim(hf_config)
    return get_rope(
        head_size=head_dim,
        rotary_dim=int(head_dim * partial_rotary_factor),
        max_position=hf_config["max_position_embeddings"],
        base=base,
        rope_scaling=rope_scaling,
        is_neox_style=True,
        dtype=dtype,
    )


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up in one GEMM."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        super().__init__()
        divide(intermediate_size, tensor_parallel_rank_and_size()[1], "intermediate_size")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias,
            prefix=f"{prefix}.gate_up_proj",
            quant_config=quant_config,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias,
            prefix=f"{prefix}.down_proj",
            quant_config=quant_config,
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        return self.down_proj(self.act_fn(gate_up))  # (T, hidden)


class LlamaAttention(nn.Module):
    """qkv projection -> rotary -> paged attention (custom op) -> output projection.

    ``scale`` (default ``head_dim ** -0.5``) and ``sliding_window`` (default the architecture's
    ``attention_window``) are given where they differ per model or per layer (Gemma 3)."""

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
        super().__init__()
        hidden_size = hf_config["hidden_size"]
        self.head_dim = _head_dim(hf_config)
        total_num_heads = hf_config["num_attention_heads"]
        total_num_kv_heads = hf_config.get("num_key_value_heads") or total_num_heads
        qkv_bias, o_proj_bias = self.projection_biases(hf_config)
        quant_config = get_quant_config(config.model_config)
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            total_num_heads,
            total_num_kv_heads,
            qkv_bias,
            prefix=f"{prefix}.qkv_proj",
            quant_config=quant_config,
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # this rank's (replicated if few)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_dim,
            hidden_size,
            o_proj_bias,
            prefix=f"{prefix}.o_proj",
            quant_config=quant_config,
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            self.num_kv_heads,
            config=config,
            prefix=f"{prefix}.attn",
            sliding_window=sliding_window or self.attention_window(hf_config),
        )

    @staticmethod
    def attention_window(hf_config: dict[str, Any]) -> int | None:
        """The sliding window of every layer; Llama's: none, each query sees its whole context."""
        return None

    @staticmethod
    def projection_biases(hf_config: dict[str, Any]) -> tuple[bool, bool]:
        """``(qkv_proj, o_proj)`` biases: Llama's ``attention_bias`` sets both."""
        bias = bool(hf_config["attention_bias"])
        return bias, bias

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, (Hq + 2 * Hkv) * D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)  # (T, Hq * D)
        return self.o_proj(attn_output)  # (T, hidden)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried through the fused add of ``RMSNorm``."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    reads_mlp_bias: ClassVar[bool] = True  # config.json's mlp_bias (Qwen's MLPs never have one)

    def __init__(
        self,
        hf_config: dict[str, Any],
        rotary_emb: RotaryEmbedding,
        *,
        config: EngineConfig,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden_size, eps = hf_config["hidden_size"], hf_config["rms_norm_eps"]
        self.self_attn = self.attention_cls(
            hf_config, rotary_emb, config=config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(
            hidden_size,
            hf_config["intermediate_size"],
            self.reads_mlp_bias and hf_config["mlp_bias"],
            prefix=f"{prefix}.mlp",
            quant_config=get_quant_config(config.model_config),
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

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = with_architecture_defaults(config.model_config.hf_config)
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
            self.decoder_layer_cls(
                hf_config, rotary_emb, config=config, prefix=maybe_prefix(prefix, f"layers.{i}")
            )
            for i in range(hf_config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hf_config["hidden_size"], hf_config["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # (T, hidden)


class LlamaForCausalLM(CausalLM):
    """``LlamaModel`` plus the LM head and HF-checkpoint loading (``CausalLM``)."""

    model_cls = LlamaModel
