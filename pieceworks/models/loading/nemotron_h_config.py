"""How a Nemotron-H config.json lays out its layers, and its Mamba fields under Bamba's names.

transformers 5.25's ``NemotronHConfig`` saves the layer layout as ``layers_block_type``, a list of
``"linear_attention"`` (a Mamba2 mixer), ``"full_attention"``, ``"mlp"`` and ``"moe"``; checkpoints
written before it carry ``hybrid_override_pattern`` instead, one character a layer (``M``, ``*``,
``-``, ``E``), and a ``num_hidden_layers`` that transformers ignores. ``nemotron_h_layer_types``
reads either; ``nemotron_h_mamba_fields`` renames the Mamba fields to those ``MambaMixer2`` reads.
The model (``models/nemotron_h.py``) and the config check (``config_checks.py``) both read these;
this module builds nothing and imports no model.
"""

from __future__ import annotations

from typing import Any

LAYER_TYPE_OF_SYMBOL = {
    "M": "linear_attention",
    "*": "full_attention",
    "-": "mlp",
    "E": "moe",
}
SUPPORTED_LAYER_TYPES = ("linear_attention", "full_attention", "mlp")


def nemotron_h_layer_types(hf_config: dict[str, Any]) -> list[str]:
    """Each layer's type: ``layers_block_type`` (or ``layer_types``), else the pattern string.

    A ``ValueError`` names the field when neither is given or a symbol is unknown.
    """
    for name in ("layers_block_type", "layer_types"):
        if hf_config.get(name) is not None:
            return list(hf_config[name])
    pattern = hf_config.get("hybrid_override_pattern")
    if not isinstance(pattern, str):
        raise ValueError(
            "a Nemotron-H config.json needs layers_block_type (a list of 'linear_attention', "
            "'full_attention', 'mlp') or hybrid_override_pattern (a string of 'M', '*', '-')"
        )
    unknown = sorted(set(pattern) - set(LAYER_TYPE_OF_SYMBOL))
    if unknown:
        raise ValueError(
            f"hybrid_override_pattern={pattern!r} has unknown symbols {unknown}; "
            f"supported: {', '.join(repr(s) for s in LAYER_TYPE_OF_SYMBOL)}"
        )
    return [LAYER_TYPE_OF_SYMBOL[symbol] for symbol in pattern]


def nemotron_h_mamba_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The Mamba2 fields of a (defaults-filled) Nemotron-H config under Bamba's names.

    The mixer's intermediate size is ``mamba_num_heads * mamba_head_dim`` (``expand`` is not
    read); ``in_proj`` and ``out_proj`` carry a bias when ``use_bias`` is set; the gated norm's
    epsilon is ``layer_norm_epsilon``.
    """
    hidden_size = hf_config["hidden_size"]
    num_heads, head_dim = hf_config["mamba_num_heads"], hf_config["mamba_head_dim"]
    return {
        "hidden_size": hidden_size,
        "mamba_n_heads": num_heads,
        "mamba_d_head": head_dim,
        "mamba_expand": num_heads * head_dim / hidden_size,
        "mamba_n_groups": hf_config["n_groups"],
        "mamba_d_state": hf_config["ssm_state_size"],
        "mamba_d_conv": hf_config["conv_kernel"],
        "mamba_proj_bias": hf_config["use_bias"],
        "mamba_conv_bias": hf_config["use_conv_bias"],
        "rms_norm_eps": hf_config["layer_norm_epsilon"],
        "time_step_limit": hf_config.get("time_step_limit"),
    }
