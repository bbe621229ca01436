"""What an absent or null config.json field means: the value transformers' config class gives it.

``ABSENT_FIELD_DEFAULTS`` holds, per architecture, the defaults of transformers' ``LlamaConfig``,
``BambaConfig``, ``Qwen2Config``, ``Qwen3Config``, ``MistralConfig`` and ``Gemma3TextConfig`` for
the fields the models read; ``with_architecture_defaults`` fills them into a config dict, and for
Gemma 3 also derives what ``Gemma3TextConfig.__post_init__`` derives from older config.json files
(``layer_types`` from ``sliding_window_pattern``; the per-layer-type ``rope_parameters`` from
``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling``). The engine fills them once when it
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
    # Gemma3TextConfig's; its MLP has no bias and its activation is hidden_activation (the
    # class has no hidden_act): neither mlp_bias nor hidden_act is read.
    "Gemma3ForCausalLM": {
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "use_bidirectional_attention": False,
    },
    # Mistral reads no bias field. Its sliding_window is not here: absent it is 4096 but null
    # means no window, which a default filled for null too would lose (``models/mistral.py``).
    "MistralForCausalLM": {
        **{k: v for k, v in _LLAMA_DEFAULTS.items() if k not in ("attention_bias", "mlp_bias")},
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
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
# Gemma3TextConfig: a layer is full attention every sliding_window_pattern-th (1-based) layer;
# full layers rotate with rope_theta (and rope_scaling), sliding ones with rope_local_base_freq.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def gemma3_layer_types(hf_config: dict[str, Any]) -> list[str]:
    """``layer_types``, or what ``Gemma3TextConfig`` derives without it."""
    if hf_config.get("layer_types") is not None:
        return list(hf_config["layer_types"])
    pattern = hf_config.get("sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(hf_config["num_hidden_layers"])
    ]


def gemma3_rope_parameters(hf_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"full_attention": {...}, "sliding_attention": {...}}`` as ``Gemma3TextConfig``'s
    ``convert_rope_params_to_dict`` builds it: transformers 5's nested ``rope_parameters`` where
    config.json has them, each completed from the older keys (``rope_scaling`` for the full
    layers, ``rope_theta``, ``rope_local_base_freq``) and the class's thetas."""
    given = hf_config.get("rope_parameters") or {}
    nested = {
        layer_type: dict(given.get(layer_type) or {"rope_type": "default"})
        for layer_type in GEMMA3_DEFAULT_THETA
    }
    if hf_config.get("rope_scaling"):
        nested["full_attention"].update(hf_config["rope_scaling"])
    older = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
    for layer_type, key in older.items():
        theta = hf_config.get(key)
        nested[layer_type].setdefault(
            "rope_theta", GEMMA3_DEFAULT_THETA[layer_type] if theta is None else theta
        )
    return nested


def _gemma3_derived(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Derived where the fields they come from have the right types (``config_checks`` refuses
    the others with the field named)."""
    derived: dict[str, Any] = {}
    pattern = hf_config.get("sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN
    layers = hf_config.get("num_hidden_layers")
    if hf_config.get("layer_types") is None and _is_positive_int(pattern, layers):
        derived["layer_types"] = gemma3_layer_types(hf_config)
    given, scaling = hf_config.get("rope_parameters"), hf_config.get("rope_scaling")
    if isinstance(given, dict | None) and isinstance(scaling, dict | None):
        per_type = [(given or {}).get(layer_type) for layer_type in GEMMA3_DEFAULT_THETA]
        if all(isinstance(params, dict | None) for params in per_type):
            derived["rope_parameters"] = gemma3_rope_parameters(hf_config)
    return derived


def _is_positive_int(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


# Fields an architecture's config class computes from others; given the config with its
# defaults filled, each returns them (config.json's own value where it carries a complete one).
_DERIVED_FIELDS = {"Gemma3ForCausalLM": _gemma3_derived}


def with_architecture_defaults(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``hf_config`` with its architecture's ``ABSENT_FIELD_DEFAULTS`` filled in where absent
    or null (a new dict; the same one where there is nothing to fill)."""
    architectures = hf_config.get("architectures") or []
    supported = [name for name in architectures if name in ABSENT_FIELD_DEFAULTS]
    architecture = supported[0] if supported else None
    defaults = ABSENT_FIELD_DEFAULTS.get(architecture or "", {})
    absent = {name: value for name, value in defaults.items() if hf_config.get(name) is None}
    filled = {**hf_config, **absent} if absent else hf_config
    derive = _DERIVED_FIELDS.get(architecture or "")
    if derive is None:
        return filled
    derived = derive(filled)
    changed = {name: value for name, value in derived.items() if filled.get(name) != value}
    return {**filled, **changed} if changed else filled
