"""The ``gpt_fast`` peer's model: an independent, hand-written Llama in the style of gpt-fast.

It shares nothing with pieceworks' model code or with HF's: its own modules in plain torch
(RMSNorm, rotary with Llama 3 frequency scaling, SwiGLU MLP, GQA attention), a static KV cache of
``(batch, kv_heads, max_len, head_dim)`` buffers written in place with ``index_copy_``, positions
passed as a tensor (``input_pos``), q/k/v in one matmul per layer (``fuse_qkv``, gpt-fast's
``wqkv``). A one-token step attends with ``flex_attention`` and ``enable_gqa`` over a causal
``BlockMask`` made once for the cache and offset to the step's position (``decode_mask``): each
KV head is read once for its query heads, the cache is split across programs, and the blocks past
the position are skipped. A prompt takes SDPA under a boolean causal mask, the ``n_rep`` query
heads of a KV head folded into the query length (``(B, H, T, D) -> (B, H_kv, n_rep * T, D)``) so
no K/V copy per query head is made.

The causal block masks (``causal_block_mask``, ``decode_mask``) are also the ``static_compiled``
peer's decode attention. The loop that runs this model is ``gpt_fast.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def rope_inv_freq(hf_config: dict[str, Any]) -> torch.Tensor:
    """Rotary inverse frequencies ``(head_dim / 2,)``, with Llama 3's scaling when configured."""
    head_dim = _head_dim(hf_config)
    parameters = hf_config.get("rope_parameters") or {}
    theta = hf_config.get("rope_theta") or parameters.get("rope_theta") or 10000.0
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = hf_config.get("rope_scaling") or parameters
    if (scaling.get("rope_type") or scaling.get("type")) != "llama3":
        return inv_freq.float()
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled).float()


def _head_dim(hf_config: dict[str, Any]) -> int:
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, heads, T, D)`` rotated by ``cos``/``sin`` ``(T, D)`` (halves, not pairs)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class KVCache(nn.Module):
    """Static ``(batch, kv_heads, max_len, head_dim)`` key and value buffers, written in place."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype: Any):
        super().__init__()
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        hidden = hf_config["hidden_size"]
        self.num_heads = hf_config["num_attention_heads"]
        self.num_kv_heads = hf_config.get("num_key_value_heads") or self.num_heads
        self.head_dim = _head_dim(hf_config)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.qkv_proj: nn.Linear | None = None  # set by fuse_qkv(): q, k and v in one matmul
        self.kv_cache: KVCache | None = None

    def fuse_qkv(self) -> None:
        """Replace the three projections by one ``qkv_proj`` of their concatenated weights."""
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        self.qkv_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.qkv_proj.weight = nn.Parameter(weight, requires_grad=False)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        batch, num_tokens, _ = x.shape
        kv_size = self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv_size, kv_size], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, num_tokens, self.num_kv_heads, -1).transpose(1, 2)
        v = v.view(batch, num_tokens, self.num_kv_heads, -1).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        assert self.kv_cache is not None, "setup_caches() first"
        k, v = self.kv_cache.update(input_pos, k, v)  # (B, H_kv, S, D)
        if isinstance(mask, BlockMask):  # decode: flex attention skips the blocks past the position
            grouped = self.num_heads != self.num_kv_heads
            y = flex_attention(q, k, v, block_mask=mask, enable_gqa=grouped)
            return self.o_proj(y.transpose(1, 2).reshape(batch, num_tokens, -1))
        n_rep = self.num_heads // self.num_kv_heads
        # (B, H, T, D) -> (B, H_kv, n_rep * T, D): each KV head is read once for its n_rep heads
        q = q.reshape(batch, self.num_kv_heads, n_rep * num_tokens, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(n_rep, 1))
        y = y.reshape(batch, self.num_heads, num_tokens, self.head_dim).transpose(1, 2)
        return self.o_proj(y.reshape(batch, num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        hidden, intermediate = hf_config["hidden_size"], hf_config["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        eps = hf_config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hf_config["hidden_size"], eps)
        self.self_attn = Attention(hf_config)
        self.post_attention_layernorm = RMSNorm(hf_config["hidden_size"], eps)
        self.mlp = MLP(hf_config)

    def forward(self, x: torch.Tensor, rope: Any, mask: Any, input_pos: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config["vocab_size"], hf_config["hidden_size"])
        num_layers = hf_config["num_hidden_layers"]
        self.layers = nn.ModuleList(DecoderLayer(hf_config) for _ in range(num_layers))
        self.norm = RMSNorm(hf_config["hidden_size"], hf_config.get("rms_norm_eps", 1e-6))


class GptFastLlama(nn.Module):
    """Llama in plain torch, parameter names as HF's (``model.layers.0.self_attn.q_proj``...)."""

    causal_mask: torch.Tensor
    inv_freq: torch.Tensor
    decode_block_mask: BlockMask | None

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        if hf_config.get("model_type") != "llama":
            raise ValueError(
                f"the gpt_fast loop runs Llama models; this one is {hf_config.get('model_type')!r}"
            )
        self.hf_config = hf_config
        self.model = Backbone(hf_config)
        self.lm_head = nn.Linear(hf_config["hidden_size"], hf_config["vocab_size"], bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(hf_config), persistent=False)

    @classmethod
    def empty(cls, hf_config: dict[str, Any], dtype: torch.dtype, device: Any) -> GptFastLlama:
        """The model with uninitialised weights of ``dtype`` on ``device``, allocated once (built
        on the meta device); the rotary frequencies stay float32, as HF keeps them."""
        with torch.device("meta"):
            model = cls(hf_config)
        model = model.to(dtype).to_empty(device=device)
        model.tie_weights()  # moving off the meta device makes new parameters: tie them again
        model.inv_freq = rope_inv_freq(hf_config).to(device)
        return model

    def tie_weights(self) -> None:
        if self.hf_config.get("tie_word_embeddings"):
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def setup_caches(self, batch: int, max_len: int, attention: str = "flex") -> None:
        """Allocate the KV caches and the masks once, on the parameters' device.

        ``attention="flex"``: one-token steps run ``flex_attention`` over a causal ``BlockMask``
        (gpt-fast's decode: each KV head read once for its query heads, the cache split across
        programs, the blocks past the position skipped); ``"sdpa"``: SDPA under a boolean mask
        over the whole cache, query heads folded into the query length. Prompts always take SDPA.
        """
        if attention not in ("flex", "sdpa"):
            raise ValueError(f"attention is 'flex' or 'sdpa', not {attention!r}")
        weight = self.lm_head.weight
        for layer in self.model.layers:
            layer_attention: Any = layer.self_attn
            layer_attention.kv_cache = KVCache(
                batch, layer_attention.num_kv_heads, max_len, layer_attention.head_dim, weight.dtype
            ).to(weight.device)
        causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=weight.device))
        self.register_buffer("causal_mask", causal, persistent=False)
        self.max_len = max_len
        self.decode_block_mask = None
        if attention == "flex":
            self.decode_block_mask = causal_block_mask(max_len, weight.device)

    def fuse_qkv(self) -> None:
        """One q/k/v projection per layer (gpt-fast's ``wqkv``), after the weights are loaded."""
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()  # type: ignore[union-attr,operator]

    def forward(self, token_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """``token_ids`` ``(B, T)`` at positions ``input_pos`` ``(T,)``: last logits ``(B, V)``."""
        x = self.model.embed_tokens(token_ids)
        freqs = input_pos.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        rope = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        mask: Any
        if token_ids.shape[1] == 1 and self.decode_block_mask is not None:
            mask = decode_mask(self.decode_block_mask, input_pos, self.max_len)
        else:
            mask = self.causal_mask[input_pos]  # (T, S)
        for layer in self.model.layers:
            x = layer(x, rope, mask, input_pos)
        return self.lm_head(self.model.norm(x[:, -1]))


def causal_block_mask(max_len: int, device: Any) -> BlockMask:
    """The causal ``BlockMask`` of a ``max_len`` static cache, made once."""
    return create_block_mask(_causal, None, None, max_len, max_len, device=device)


def decode_mask(block_mask: BlockMask, input_pos: torch.Tensor, max_len: int) -> BlockMask:
    """The row of ``block_mask`` for a one-token step at ``input_pos`` ``(1,)``, as gpt-fast
    takes it: the query's block of blocks, and the mask offset to the query's position."""
    mask = block_mask[:, :, input_pos // block_mask.BLOCK_SIZE[0]]
    offset = input_pos[0]

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx + offset >= kv_idx

    mask.mask_mod = mask_mod
    mask.seq_lengths = (1, max_len)
    return mask


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx
