"""Every GGUF metadata branch the loader reads, on tiny files written with gguf.GGUFWriter.

Proves: rope scaling absent, "none", "linear" (with its factor) and the older
``rope.scale_linear`` key become the config's ``rope_scaling``; "yarn" and per-frequency factors
(``rope_freqs.weight``, llama3 scaling) are refused naming the key or tensor; a file with an
``output.weight`` is untied and generates like the same untied weights in an HF directory, one
without it is tied; an absent ``head_count_kv`` means one KV head per query head and a per-layer
list is refused naming the key; ``key_length`` sets the head dimension, and a ``value_length``
or ``rope.dimension_count`` unlike it, experts, a sliding window and an unknown
``general.architecture`` are refused naming the key; an absent ``vocab_size`` is the token count
and an absent ``rope.freq_base`` is 10000; absent bos/eos ids are None; the file's tensor types
set ``torch_dtype``; BF16, Q4_1, Q5_0 and Q5_1 tensors dequantize; the tokenizer without a chat
template has none, and a ``tokenizer.ggml.model`` other than llama or gpt2 is refused naming it.
Run: pytest tests/models/loading/test_gguf_metadata.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pieceworks.engine.tokenizer import gguf_tokenizer
from pieceworks.models.loading import gguf_loader
from pieceworks.models.loading.gguf_loader import GGUFMetadataError, gguf_hf_config
from pieceworks.models.loading.presets import random_hf_checkpoint, random_hf_weights
from tests.models.loading.test_gguf import HF_CONFIG, TOKENS, write_gguf

gguf = pytest.importorskip("gguf")

UNTIED = {**HF_CONFIG, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return dict(random_hf_weights(HF_CONFIG, seed=5, dtype=torch.float32))


def _config(tmp_path: Path, weights, **kwargs) -> dict:
    return gguf_hf_config(write_gguf(tmp_path / "m.gguf", weights, **kwargs))


def _refused(tmp_path: Path, weights, match: str, **kwargs) -> None:
    with pytest.raises(GGUFMetadataError, match=match):
        _config(tmp_path, weights, **kwargs)


def test_rope_scaling_absent_none_and_linear(tmp_path, weights):
    assert _config(tmp_path, weights)["rope_scaling"] is None

    def none(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)

    assert _config(tmp_path, weights, extra=none)["rope_scaling"] is None

    def linear(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    linear_config = _config(tmp_path, weights, extra=linear)
    assert linear_config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}

    def old_linear(writer):
        writer.add_float32("llama.rope.scale_linear", 2.0)

    assert _config(tmp_path, weights, extra=old_linear)["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 2.0,
    }


def test_linear_rope_without_its_factor_names_the_key(tmp_path, weights):
    def linear(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)

    _refused(tmp_path, weights, "llama.rope.scaling.factor", extra=linear)


def test_yarn_rope_scaling_is_refused_naming_the_key(tmp_path, weights):
    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    _refused(tmp_path, weights, r"llama\.rope\.scaling\.type='yarn' is not supported", extra=yarn)


def test_llama3_rope_factors_are_refused_naming_the_tensor(tmp_path, weights):
    def rope_freqs(writer):
        writer.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))

    _refused(tmp_path, weights, r"rope_freqs\.weight", extra=rope_freqs)


def test_an_output_tensor_unties_the_embeddings(tmp_path, weights):
    assert _config(tmp_path, weights)["tie_word_embeddings"] is True
    untied = dict(random_hf_weights(UNTIED, seed=6, dtype=torch.float32))
    assert "lm_head.weight" in untied
    path = write_gguf(tmp_path / "untied.gguf", untied, hf_config=UNTIED)
    config = gguf_hf_config(path)
    assert config["tie_word_embeddings"] is False
    loaded = dict(gguf_loader.gguf_weights_iterator(path, config))
    assert torch.equal(loaded["lm_head.weight"], untied["lm_head.weight"])


def test_an_untied_gguf_generates_like_the_same_weights_in_an_hf_directory(tmp_path):
    from pieceworks.engine.llm import LLM
    from pieceworks.sampling_params import SamplingParams

    untied = dict(random_hf_weights(UNTIED, seed=6, dtype=torch.float32))
    gguf_path = write_gguf(tmp_path / "untied.gguf", untied, hf_config=UNTIED)
    hf_dir = random_hf_checkpoint(UNTIED, tmp_path / "hf", seed=6, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for model in (str(gguf_path), str(hf_dir)):
        llm = LLM(model, compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)
        outputs[model] = llm.generate([[7, 100, 42], [200, 3]], params)
    for ours, theirs in zip(outputs[str(gguf_path)], outputs[str(hf_dir)]):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids


def test_absent_head_count_kv_is_one_per_query_head(tmp_path, weights):
    config = _config(tmp_path, weights, skip_keys=("llama.attention.head_count_kv",))
    assert config["num_key_value_heads"] == HF_CONFIG["num_attention_heads"]


def test_per_layer_head_count_kv_is_refused_naming_the_key(tmp_path, weights):
    def per_layer(writer):
        writer.add_head_count_kv([2, 1])

    skip = ("llama.attention.head_count_kv",)
    _refused(tmp_path, weights, "llama.attention.head_count_kv", skip_keys=skip, extra=per_layer)


def test_key_length_and_rope_dimension_count_equal_to_the_head_dim_pass(tmp_path, weights):
    head_dim = HF_CONFIG["hidden_size"] // HF_CONFIG["num_attention_heads"]

    def lengths(writer):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)

    config = _config(tmp_path, weights, extra=lengths)
    assert config["head_dim"] == head_dim and "partial_rotary_factor" not in config


@pytest.mark.parametrize(
    ("add", "match"),
    [
        (lambda w: w.add_rope_dimension_count(8), r"llama\.rope\.dimension_count=8"),
        (lambda w: w.add_value_length(8), r"llama\.attention\.value_length=8"),
        (lambda w: w.add_expert_count(8), r"llama\.expert_count=8"),
        (lambda w: w.add_sliding_window(4096), r"llama\.attention\.sliding_window=4096"),
    ],
)
def test_unsupported_shape_keys_are_refused_naming_the_key(tmp_path, weights, add, match):
    _refused(tmp_path, weights, match, extra=add)


def test_an_unknown_architecture_is_refused_naming_the_key(tmp_path, weights):
    _refused(tmp_path, weights, r"general\.architecture='falcon' is not supported", arch="falcon")


def test_absent_optional_keys_take_their_defaults(tmp_path, weights):
    skip = (
        "llama.vocab_size",
        "llama.rope.freq_base",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
    )
    config = _config(tmp_path, weights, skip_keys=skip)
    assert config["vocab_size"] == len(TOKENS)
    assert config["rope_theta"] == 10000.0
    assert config["bos_token_id"] is None and config["eos_token_id"] is None


@pytest.mark.parametrize(
    ("types", "dtype"),
    [({}, "float32"), ({"F16": "all"}, "float16"), ({"Q8_0": "one"}, "bfloat16")],
)
def test_the_tensor_types_set_torch_dtype(tmp_path, weights, types, dtype):
    tensor_types = {}
    for type_name, which in types.items():
        names = list(weights) if which == "all" else ["model.layers.1.mlp.down_proj.weight"]
        tensor_types.update({name: gguf.GGMLQuantizationType[type_name] for name in names})
    if "F16" in types:  # the norms stay F32 in llama.cpp's files too
        tensor_types = {k: v for k, v in tensor_types.items() if "norm" not in k}
    assert _config(tmp_path, weights, tensor_types=tensor_types)["torch_dtype"] == dtype


@pytest.mark.parametrize("qtype_name", ["BF16", "Q4_1", "Q5_0", "Q5_1"])
def test_more_quantized_types_are_dequantized(tmp_path, weights, qtype_name):
    qtype = gguf.GGMLQuantizationType[qtype_name]
    name = "model.layers.1.mlp.down_proj.weight"
    path = write_gguf(tmp_path / "q.gguf", weights, tensor_types={name: qtype})
    loaded = dict(gguf_loader.gguf_weights_iterator(path, HF_CONFIG))[name]
    reference = weights[name]
    tolerance = {"BF16": 1e-2, "Q4_1": 1 / 15, "Q5_0": 1 / 30, "Q5_1": 1 / 30}[qtype_name]
    assert (loaded - reference).abs().max() <= tolerance * reference.abs().max()


def test_a_tokenizer_without_a_chat_template_has_none(tmp_path, weights):
    path = write_gguf(tmp_path / "m.gguf", weights, skip_keys=("tokenizer.chat_template",))
    assert gguf_tokenizer(path).chat_template is None


def test_an_unknown_tokenizer_model_is_refused_naming_the_key(tmp_path, weights):
    def bert(writer):
        writer.add_tokenizer_model("bert")

    path = write_gguf(tmp_path / "m.gguf", weights, skip_keys=("tokenizer.ggml.model",), extra=bert)
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='bert' is not supported"):
        gguf_tokenizer(path)
