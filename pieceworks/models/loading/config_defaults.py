"""What an absent or null config.json field means: the value transformers' config class gives it.

``ABSENT_FIELD_DEFAULTS`` holds, per architecture, the defaults of transformers' ``LlamaConfig``,
``BambaConfig``, ``Qwen2Config`` and ``Qwen3Config`` for the fields the models read;
``with_architecture_defaults`` fills them into a config dict. The engine fills them once when it
builds the model config, and each model fills them again when built from a hand-made config, so
no reader needs a fallback of its own. ``docs/models.md`` lists them.
"""

from __future__ import annotations

from typing import Any

# What transformers' config class (``LlamaConfig``, ``BambaConfig``, ``Qwen2Config``,
# ``Qwen3Config``) gives a field that config.json leaves out or sets to null: that value applies,
# as in transformers. Sizes (vocab, hidden, intermediate, layers, heads, Mamba heads and state)
# are not filled: their defaults describe a 7B model, so a config without one is refused instead.
# ``head_dim`` absent in Llama and Bamba and ``num_key_value_heads`` absent in Llama are derived
# (hidden_size / heads, the heads), as transformers derives them, by the models. Every
# architecture's rope_theta default is transformers' ``default_theta``.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_theta": 10000.0,
}
_QWEN_DEFAULTS: dict[str, Any] = {
    **_LLAMA_DEFAULTS,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
}
ABSENT_FIELD_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": _LLAMA_DEFAULTS,
    "BambaForCausalLM": {
        **_LLAMA_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 262144,
        "num_key_value_heads": 8,
        "mamba_d_head": "auto",
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
    },
    # Qwen2's attention biases are fixed (q, k, v: yes; o, MLP: no): the fields are not read.
    "Qwen2ForCausalLM": {
        k: v for k, v in _QWEN_DEFAULTS.items() if k not in ("attention_bias", "mlp_bias")
    },
    "Qwen3ForCausalLM": {
        **{k: v for k, v in _QWEN_DEFAULTS.items() if k != "mlp_bias"},
        "head_dim": 128,
    },
    # NemotronHConfig: no rope fields (its attention has no rotary embedding).
    "NemotronHForCausalLM": {
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "num_key_value_heads": 8,
        "head_dim": 128,
        "mamba_hidden_act": "silu",
        "n_groups": 8,
        "conv_kernel": 4,
        "chunk_size": 128,
        "use_conv_bias": True,
        "use_bias": False,
    },
    # Qwen3_5TextConfig; its partial_rotary_factor (0.25) is read by models/qwen3_5.py.
    "Qwen3_5ForCausalLM": {
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "rope_theta": 10000.0,
    },
}


def with_architecture_defaults(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``hf_config`` with its architecture's ``ABSENT_FIELD_DEFAULTS`` filled in where absent
    or null (a new dict; the same one where there is nothing to fill)."""
    architectures = hf_config.get("architectures") or []
    supported = [name for name in architectures if name in ABSENT_FIELD_DEFAULTS]
    defaults = ABSENT_FIELD_DEFAULTS.get(supported[0], {}) if supported else {}
    absent = {name: value for name, value in defaults.items() if hf_config.get(name) is None}
    return {**hf_config, **absent} if absent else hf_config
