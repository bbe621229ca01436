"""The config.json fields of the hybrid architectures beyond Bamba, and their layer checks.

``config_checks.py`` derives each one's table from its ``COMMON_RULES``: the ``*_FIELDS`` below are
added (or replace the common rule of that name), the ``*_DROPPED`` names are removed because
transformers does not read them for the architecture (so they pass whatever they say). The
``check_*_layers`` functions check what one field cannot: the layer layout against the sizes.
``docs/models.md`` lists the decisions.
"""

from __future__ import annotations

import math
from typing import Any

from pieceworks.models.loading.field_rules import (
    REQUIRED,
    FieldRule,
    ModelConfigError,
    is_bool,
    neutral,
    non_negative_number,
    one_of,
    positive_int,
    size,
)
from pieceworks.models.loading.nemotron_h_config import (
    SUPPORTED_LAYER_TYPES,
    nemotron_h_layer_types,
)


def _no_time_step_limit(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and list(value) == [0.0, math.inf]


# Nemotron-H: transformers' NemotronHConfig / NemotronHForCausalLM (5.25).
NEMOTRON_H_FIELDS = (
    FieldRule("mlp_hidden_act", one_of("relu2"), "'relu2' (the MLP is relu(up)**2)", "relu2"),
    FieldRule("mamba_hidden_act", one_of("silu"), "'silu' (the conv's activation)", "silu"),
    FieldRule("layer_norm_epsilon", non_negative_number, "a finite number >= 0", 1e-5),
    size("mamba_num_heads"),
    size("mamba_head_dim"),
    size("ssm_state_size"),
    FieldRule("n_groups", positive_int, "a positive integer dividing mamba_num_heads", 8),
    FieldRule("conv_kernel", positive_int, "a positive integer", 4),
    FieldRule("chunk_size", positive_int, "a positive integer (any value computes alike)", 128),
    FieldRule("use_conv_bias", is_bool, "true or false (the conv's bias)", True),
    FieldRule("use_bias", is_bool, "true or false (the Mamba in_proj / out_proj biases)", False),
    # transformers applies a limit only in its chunked prefill scan, not in its decode step.
    FieldRule(
        "time_step_limit",
        _no_time_step_limit,
        "[0.0, Infinity] (transformers applies another limit to prefills only)",
    ),
    FieldRule("num_hidden_layers", positive_int, "any (the layer layout gives the count)"),
    FieldRule(
        "layers_block_type",
        lambda value: isinstance(value, list) and all(t in SUPPORTED_LAYER_TYPES for t in value),
        "a list of 'linear_attention', 'full_attention' and 'mlp' ('moe' is not implemented)",
    ),
    FieldRule(
        "hybrid_override_pattern",
        lambda value: isinstance(value, str) and set(value) <= set("M*-"),
        "a string of 'M', '*' and '-' ('E', a mixture-of-experts layer, is not implemented)",
    ),
    # Names transformers reads only under their current spelling when config.json has both.
    *(
        FieldRule(name, neutral(), f"absent (this field is spelled {current!r})")
        for name, current in (
            ("mamba_n_groups", "n_groups"),
            ("mamba_d_conv", "conv_kernel"),
            ("mamba_conv_bias", "use_conv_bias"),
            ("mamba_dt_limit", "time_step_limit"),
        )
    ),
)
# Not read by transformers' Nemotron-H: its attention has no biases, no sliding window.
NEMOTRON_H_DROPPED = (
    "hidden_act",
    "rms_norm_eps",
    "attention_bias",
    "sliding_window",
    "use_sliding_window",
    "num_hidden_layers",
)


def check_nemotron_h_layers(hf_config: dict[str, Any], source: str) -> None:
    """The layer layout (with the MoE layers refused by name) and the Mamba head groups."""
    try:
        layer_types = nemotron_h_layer_types(hf_config)
    except ValueError as error:
        raise ModelConfigError(f"{source}: {error}") from None
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported or not layer_types:
        raise ModelConfigError(
            f"{source}: Nemotron-H layer types {unsupported or 'none'} are not supported; "
            f"supported: {', '.join(SUPPORTED_LAYER_TYPES)} (mixture-of-experts layers are not "
            "implemented)"
        )
    heads, groups = hf_config["mamba_num_heads"], hf_config["n_groups"]
    if heads % groups:
        raise ModelConfigError(f"{source}: n_groups={groups} must divide mamba_num_heads={heads}")
    old_head_dim = hf_config.get("attention_head_dim")
    if old_head_dim is not None and old_head_dim != hf_config["head_dim"]:
        raise ModelConfigError(
            f"{source}: attention_head_dim={old_head_dim} differs from head_dim="
            f"{hf_config['head_dim']}, the one transformers reads; set head_dim"
        )


def _list_of(*types: str):
    return lambda value: isinstance(value, list) and all(t in types for t in value)


# Qwen3.5 text: transformers' Qwen3_5TextConfig / Qwen3_5ForCausalLM (5.25).
QWEN3_5_FIELDS = (
    FieldRule(
        "layer_types",
        _list_of("linear_attention", "full_attention"),
        "a list of 'linear_attention' and 'full_attention', one a layer",
        REQUIRED,
    ),
    FieldRule("full_attention_interval", positive_int, "any (layer_types gives the layout)"),
    size("linear_num_key_heads"),
    size("linear_num_value_heads"),
    size("linear_key_head_dim"),
    size("linear_value_head_dim"),
    FieldRule("linear_conv_kernel_dim", positive_int, "a positive integer", 4),
)
# Not read by transformers' Qwen3.5: its MLP has no biases.
QWEN3_5_DROPPED = ("mlp_bias",)


def check_qwen3_5_layers(hf_config: dict[str, Any], source: str) -> None:
    """One layer type a layer; value heads a multiple of key heads."""
    num_layers, layer_types = hf_config["num_hidden_layers"], hf_config["layer_types"]
    if len(layer_types) != num_layers:
        raise ModelConfigError(
            f"{source}: layer_types has {len(layer_types)} entries for num_hidden_layers="
            f"{num_layers}; give one a layer"
        )
    k_heads, v_heads = hf_config["linear_num_key_heads"], hf_config["linear_num_value_heads"]
    if v_heads % k_heads:
        raise ModelConfigError(
            f"{source}: linear_num_key_heads={k_heads} must divide linear_num_value_heads={v_heads}"
        )
