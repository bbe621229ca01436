"""A config.json field left out means what transformers' config class says, for every architecture.

Proves: each value of ``ABSENT_FIELD_DEFAULTS`` is the installed transformers config class's own
default (``LlamaConfig``, ``BambaConfig``, ``Qwen2Config``, ``Qwen3Config``, ``MistralConfig``,
``Gemma3TextConfig``), filled where the field is absent or null and never over a present one; the
engine's model config carries them (Bamba's ``max_position_embeddings`` limits ``max_model_len``
as transformers' 262144 would); a Llama checkpoint whose config.json lacks every field with a
default (``tie_word_embeddings`` included: untied, the checkpoint's ``lm_head`` is used) gives
transformers' logits; so does a Bamba checkpoint lacking its defaulted fields (``rms_norm_eps``
1e-5, 8 KV heads, ``mamba_d_head`` "auto", ...); a top-level ``partial_rotary_factor`` other
than 0.5, which transformers' Bamba ignores, is refused.
Run: pytest tests/models/loading/test_config_defaults.py
"""

from __future__ import annotations

import json

import pytest
import torch

from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.config_checks import ModelConfigError, check_hf_config
from pieceworks.models.loading.config_defaults import (
    ABSENT_FIELD_DEFAULTS,
    with_architecture_defaults,
)
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint

transformers = pytest.importorskip("transformers")

CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "BambaForCausalLM": "BambaConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "MistralForCausalLM": "MistralConfig",
    "NemotronHForCausalLM": "NemotronHConfig",
    "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
}


def _transformers_default(config_cls: str, field: str):
    config = getattr(transformers, config_cls)()
    if field == "rope_theta":
        return config.rope_parameters["rope_theta"]
    return getattr(config, field)


@pytest.mark.parametrize(
    ("architecture", "field"),
    [(arch, field) for arch, table in ABSENT_FIELD_DEFAULTS.items() for field in table],
)
def test_each_default_is_the_transformers_config_class_default(architecture, field):
    config_cls = CONFIG_CLASSES[architecture]
    if field == "mamba_d_head":  # "auto" is resolved by BambaConfig.__post_init__
        assert transformers.BambaConfig(mamba_d_head="auto").mamba_d_head == 2 * 4096 // 128
        assert ABSENT_FIELD_DEFAULTS[architecture][field] == "auto"
        return
    assert ABSENT_FIELD_DEFAULTS[architecture][field] == _transformers_default(config_cls, field)


def test_every_architecture_has_a_table():
    assert sorted(ABSENT_FIELD_DEFAULTS) == sorted(CONFIG_CLASSES)


def test_absent_and_null_fields_are_filled_present_ones_kept():
    llama = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": None, "mlp_bias": True}
    filled = with_architecture_defaults(llama)
    assert filled["rms_norm_eps"] == 1e-6 and filled["mlp_bias"] is True
    assert filled["tie_word_embeddings"] is False and filled["max_position_embeddings"] == 2048
    assert "rms_norm_eps" in llama and llama["rms_norm_eps"] is None  # the input is not changed
    complete = {**llama, **ABSENT_FIELD_DEFAULTS["LlamaForCausalLM"]}
    assert with_architecture_defaults(complete) is complete
    unknown = {"architectures": ["GPT2LMHeadModel"]}
    assert with_architecture_defaults(unknown) is unknown
    bamba = with_architecture_defaults({"architectures": ["BambaForCausalLM"]})
    assert (bamba["rms_norm_eps"], bamba["num_key_value_heads"]) == (1e-5, 8)


def test_the_engine_config_carries_the_defaults(tmp_path):
    bamba = {k: v for k, v in get_preset("bamba-tiny").items() if k != "max_position_embeddings"}
    path = random_hf_checkpoint(bamba, tmp_path, seed=0, dtype=torch.float32)
    config = build_engine_config(str(path), max_model_len=16384)
    assert config.model_config.hf_config["max_position_embeddings"] == 262144
    assert config.model_config.max_model_len == 16384


def test_bamba_top_level_partial_rotary_factor_is_refused_unless_half():
    bamba = get_preset("bamba-tiny")
    assert check_hf_config({**bamba, "partial_rotary_factor": 0.5}) == "BambaForCausalLM"
    with pytest.raises(ModelConfigError, match="partial_rotary_factor=0.25 at the top level"):
        check_hf_config({**bamba, "partial_rotary_factor": 0.25})
    nested = {**bamba, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}
    del nested["partial_rotary_factor"]
    assert check_hf_config(nested) == "BambaForCausalLM"
    # transformers agrees: the top-level value is ignored, the nested one honoured
    assert (
        transformers.BambaConfig(partial_rotary_factor=0.25).rope_parameters[
            "partial_rotary_factor"
        ]
        == 0.5
    )


def _strip(path, fields) -> dict:
    """Delete ``fields`` from the config.json under ``path``; return what is left."""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    for field in fields:
        config.pop(field, None)
        (config.get("rope_parameters") or {}).pop(field, None)
    config_path.write_text(json.dumps(config))
    return config


LLAMA_ABSENT = [
    *ABSENT_FIELD_DEFAULTS["LlamaForCausalLM"],
    "head_dim",
    "num_key_value_heads",
    "pretraining_tp",
]


def test_llama_config_without_defaulted_fields_gives_transformers_logits(tmp_path):
    from tests.models.test_llama_hf import run_and_compare

    small = get_preset("llama-tiny")
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    hf_config = transformers.LlamaConfig(
        vocab_size=small["vocab_size"], **{key: small[key] for key in keys}
    )
    hf_config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.save_pretrained(tmp_path)
    left = _strip(tmp_path, LLAMA_ABSENT)
    assert not set(LLAMA_ABSENT) & set(left)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # untied: the checkpoint's own lm_head, not the embedding
    assert hf_model.config.tie_word_embeddings is False
    assert not torch.equal(hf_model.lm_head.weight, hf_model.model.embed_tokens.weight)
    llm = LLM(str(tmp_path), compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)
    assert llm.engine.config.model_config.hf_config["tie_word_embeddings"] is False
    assert run_and_compare(llm, hf_model, [[1, 2, 3, 4], [5, 6, 7]], steps=3) == 2 * 3


BAMBA_ABSENT = [
    *ABSENT_FIELD_DEFAULTS["BambaForCausalLM"],
    "partial_rotary_factor",
    "time_step_limit",
]


def test_bamba_config_without_defaulted_fields_gives_transformers_logits(tmp_path):
    from tests.models.test_llama_hf import run_and_compare

    small = get_preset("bamba-tiny")
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "attn_layer_indices")
    keys += ("mamba_n_heads", "mamba_d_state", "vocab_size")
    hf_config = transformers.BambaConfig(
        num_attention_heads=8,  # the default 8 KV heads need 8 query heads here
        **{key: small[key] for key in keys},
    )
    hf_config.architectures = ["BambaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # ones by default, which would hide which eps and weight apply
                param.normal_(1.0, 0.1)
    model.save_pretrained(tmp_path)
    left = _strip(tmp_path, BAMBA_ABSENT)
    assert not set(BAMBA_ABSENT) & set(left)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert hf_model.config.rms_norm_eps == 1e-5 and hf_model.config.num_key_value_heads == 8
    llm = LLM(
        str(tmp_path),
        compilation_config={"level": 0},
        dtype="float32",
        max_num_seqs=2,
        max_model_len=64,
    )
    assert llm.engine.config.model_config.hf_config["rms_norm_eps"] == 1e-5
    assert run_and_compare(llm, hf_model, [[1, 2, 3, 4], [5, 6, 7]], steps=3) == 2 * 3
