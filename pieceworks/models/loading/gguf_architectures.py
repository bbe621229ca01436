"""Per-architecture GGUF conventions: metadata keys -> config.json, tensor names -> HF names.

Each ``GGUFArchitecture`` says, for one ``general.architecture`` value, how llama.cpp's
``convert_hf_to_gguf.py`` wrote the model: which GGUF block tensor is which HF module
(``block_tensors``), how the ``<arch>.*`` keys become the HF config dict (``hf_config``), whether
the query/key rows were permuted (llama's GPT-J-style rotary pairing) and what was added to the
norm weights (Gemma's ``x * (1 + w)`` norms are stored as ``1 + w``). ``gguf_loader.py`` applies
them; nothing here reads tensor data.

- ``llama``: ``LlamaForCausalLM``; q/k rows permuted; norms as trained.
- ``gemma3``: ``Gemma3ForCausalLM`` (text only); no permutation; every ``*norm.weight`` stored
  with 1 added, which the loader subtracts (as transformers' GGUF loader does). The file has no
  key for what llama.cpp hard-codes, so the same values are assumed here: every 6th layer global
  (``layer_types``; ``<arch>.attention.sliding_window_pattern`` overrides), local layers' rope base
  10000 (``<arch>.rope.freq_base_swa`` overrides), ``query_pre_attn_scalar`` = the head dimension
  (hidden / heads for the 62-layer 27B, llama.cpp's rule, which reproduces every Gemma 3
  config.json), GELU-tanh MLP, and ``<end_of_turn>`` as a second EOS (Gemma's
  generation_config.json stops on both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pieceworks.models.loading.gguf_metadata import (
    REQUIRED,
    GGUFMetadataError,
    file_dtype,
    float32_value,
    metadata_value,
    rope_scaling,
)

if TYPE_CHECKING:
    from gguf import GGUFReader

# GGUF names of the tensors outside the blocks -> HF module names (every architecture here).
TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# GGUF tensor names of a transformer block -> the HF module names (llama.cpp's gguf-py
# tensor_mapping, read in the other direction).
_ATTENTION_AND_MLP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    **_ATTENTION_AND_MLP,
}
GEMMA3_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",  # Gemma's norm before the MLP
    "post_ffw_norm": "post_feedforward_layernorm",
    **_ATTENTION_AND_MLP,
}
# llama.cpp's Gemma 3 constants (src/llama-model.cpp, LLM_ARCH_GEMMA3).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_NUM_LAYERS = 62
END_OF_TURN = "<end_of_turn>"


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """How llama.cpp wrote one architecture (see the module docstring)."""

    name: str
    block_tensors: Mapping[str, str]
    hf_config: Callable[[GGUFReader], dict[str, Any]]
    permuted_qk: bool
    norm_offset: float = 0.0


def _key(reader: GGUFReader, arch: str, name: str, default: Any = REQUIRED) -> Any:
    return metadata_value(reader, f"{arch}.{name}", default)


def _refuse_unsupported(reader: GGUFReader, arch: str, unsupported: Mapping[str, Any]) -> None:
    """A metadata key that changes the computation in a way pieceworks does not implement."""
    for name, off in unsupported.items():
        value = _key(reader, arch, name, off)
        if value != off:
            raise GGUFMetadataError(
                f"{reader.data.filename}: {arch}.{name}={value!r} is not supported (pieceworks' "
                f"{arch} needs it absent or {off!r}); load the model's HF directory instead"
            )


def _refuse_other_head_dims(reader: GGUFReader, arch: str, head_dim: int, keys: tuple[str, ...]):
    for name in keys:
        value = _key(reader, arch, name, head_dim)
        if value != head_dim:
            raise GGUFMetadataError(
                f"{reader.data.filename}: {arch}.{name}={value} is not supported: pieceworks' "
                f"{arch} needs it equal to the head dimension ({arch}.attention.key_length or "
                f"embedding_length / head_count = {head_dim})"
            )


def _shared_config(reader: GGUFReader, arch: str) -> dict[str, Any]:
    """The config.json entries every decoder-only architecture here reads the same way."""
    hidden_size = int(_key(reader, arch, "embedding_length"))
    num_heads = int(_key(reader, arch, "attention.head_count"))
    num_kv_heads = _key(reader, arch, "attention.head_count_kv", num_heads)
    if not isinstance(num_kv_heads, int):
        raise GGUFMetadataError(
            f"{reader.data.filename}: {arch}.attention.head_count_kv={num_kv_heads!r}: per-layer "
            "KV head counts are not supported (one integer for every layer is)"
        )
    vocab_size = _key(reader, arch, "vocab_size", None)
    if vocab_size is None:
        vocab_size = len(metadata_value(reader, "tokenizer.ggml.tokens"))
    return {
        "hidden_size": hidden_size,
        "intermediate_size": int(_key(reader, arch, "feed_forward_length")),
        "num_hidden_layers": int(_key(reader, arch, "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": int(_key(reader, arch, "attention.key_length", hidden_size // num_heads)),
        "max_position_embeddings": int(_key(reader, arch, "context_length")),
        "rms_norm_eps": float32_value(_key(reader, arch, "attention.layer_norm_rms_epsilon")),
        "rope_scaling": rope_scaling(reader, arch),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": all(tensor.name != "output.weight" for tensor in reader.tensors),
        "bos_token_id": metadata_value(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": metadata_value(reader, "tokenizer.ggml.eos_token_id", None),
        "torch_dtype": file_dtype(reader),
    }


def llama_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """HF ``LlamaConfig`` keys from ``llama.*`` metadata."""
    unsupported = {
        "expert_count": 0,  # mixture of experts
        "attention.sliding_window": 0,
        "attention.clamp_kqv": 0,
        "logit_scale": 1.0,
    }
    _refuse_unsupported(reader, "llama", unsupported)
    config = _shared_config(reader, "llama")
    head_dims = ("attention.value_length", "rope.dimension_count")
    _refuse_other_head_dims(reader, "llama", config["head_dim"], head_dims)
    tensor_names = {tensor.name for tensor in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **config,
        "rope_theta": float32_value(_key(reader, "llama", "rope.freq_base", 10000.0)),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "hidden_act": "silu",
    }


def _gemma3_layer_types(reader: GGUFReader, num_layers: int) -> list[str]:
    """``sliding_attention``/``full_attention`` per layer: the file's pattern (a period, or one
    bool per layer, true = sliding) or llama.cpp's default period of 6."""
    pattern = _key(reader, "gemma3", "attention.sliding_window_pattern", None)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise GGUFMetadataError(
                f"{reader.data.filename}: gemma3.attention.sliding_window_pattern has "
                f"{len(pattern)} entries for {num_layers} layers; re-convert the file"
            )
        sliding = [bool(value) for value in pattern]
    else:
        period = int(pattern or GEMMA3_SLIDING_WINDOW_PATTERN)
        sliding = [(layer + 1) % period != 0 for layer in range(num_layers)]
    return ["sliding_attention" if value else "full_attention" for value in sliding]


def _end_of_turn_ids(reader: GGUFReader, eos_token_id: int | None) -> list[int] | int | None:
    """EOS and the end-of-turn token (``tokenizer.ggml.eot_token_id``, else ``<end_of_turn>``
    found in the vocabulary), as Gemma's generation config lists them."""
    eot = metadata_value(reader, "tokenizer.ggml.eot_token_id", None)
    if eot is None:
        tokens = metadata_value(reader, "tokenizer.ggml.tokens", [])
        eot = tokens.index(END_OF_TURN) if END_OF_TURN in tokens else None
    ids = [token for token in (eos_token_id, eot) if token is not None]
    return ids if len(ids) > 1 else eos_token_id


def gemma3_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """HF ``Gemma3TextConfig`` keys (its config.json spelling) from ``gemma3.*`` metadata."""
    arch = "gemma3"
    _refuse_unsupported(reader, arch, {"expert_count": 0})
    config = _shared_config(reader, arch)
    head_dim = config["head_dim"]
    head_dims: tuple[str, ...] = ("attention.value_length", "rope.dimension_count")
    head_dims += ("attention.key_length_swa", "attention.value_length_swa")
    _refuse_other_head_dims(reader, arch, head_dim, head_dims)
    num_layers = config["num_hidden_layers"]
    query_pre_attn_scalar = head_dim
    if num_layers == GEMMA3_27B_NUM_LAYERS:
        query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
    final_softcap = _key(reader, arch, "final_logit_softcapping", None)
    attn_softcap = _key(reader, arch, "attn_logit_softcapping", None)
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **config,
        "eos_token_id": _end_of_turn_ids(reader, config["eos_token_id"]),
        "pad_token_id": metadata_value(reader, "tokenizer.ggml.padding_token_id", None),
        "rope_theta": float32_value(_key(reader, arch, "rope.freq_base")),
        "rope_local_base_freq": float32_value(
            _key(reader, arch, "rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)
        ),
        "sliding_window": int(_key(reader, arch, "attention.sliding_window")),
        "layer_types": _gemma3_layer_types(reader, num_layers),
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "final_logit_softcapping": None if final_softcap is None else float(final_softcap),
        "attn_logit_softcapping": None if attn_softcap is None else float(attn_softcap),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
    }


ARCHITECTURES = {
    "llama": GGUFArchitecture("llama", LLAMA_BLOCK_TENSORS, llama_hf_config, permuted_qk=True),
    "gemma3": GGUFArchitecture(
        "gemma3", GEMMA3_BLOCK_TENSORS, gemma3_hf_config, permuted_qk=False, norm_offset=1.0
    ),
}
