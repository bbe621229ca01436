"""Qwen2 and Qwen3 logits and greedy tokens equal HF transformers' on checkpoints it saved.

Each checkpoint is a tiny random model built and saved by transformers itself (``Qwen2Config`` /
``Qwen3Config``, float32), with its norms and biases drawn at random (HF initialises them to one
and zero, which would hide a norm or bias that pieceworks dropped): Qwen3 untied with ``head_dim``
unrelated to ``hidden_size``, Qwen3 tied with ``attention_bias``, Qwen2 (q, k, v biases) untied
and tied. Logits of prefill, decode, a mixed batch and a chunked prefill are within SPEC §4's
tolerance (max |diff| <= 1e-4 * max |HF logit|) at levels 0 and 3; greedy tokens equal
``generate``'s eagerly and with PIECEWISE and FULL_AND_PIECEWISE graphs (the simgraph platform
where the resolved one has no graphs); a sliding-window config is refused with the field named,
and so is ``quantization="fp8"``.
Run: pytest tests/models/test_qwen_hf.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.config_checks import ModelConfigError, check_hf_config
from tests.models.hf_reference import greedy_tokens, hf_greedy
from tests.models.test_llama_hf import run_and_compare

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
CONFIGS = {
    # 4 heads of 32: q is 128 wide against a hidden size of 64
    "qwen3-untied": ("Qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
    "qwen3-tied-bias": (
        "Qwen3",
        {"head_dim": 16, "tie_word_embeddings": True, "attention_bias": True},
    ),
    "qwen2-untied": ("Qwen2", {"tie_word_embeddings": False}),
    "qwen2-tied": ("Qwen2", {"tie_word_embeddings": True}),
}


def save_hf_checkpoint(path, family: str, fields: dict) -> None:
    """A random ``<family>ForCausalLM`` saved by transformers."""
    hf_config = getattr(transformers, f"{family}Config")(**SHAPE, **fields)
    hf_config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"{family}ForCausalLM")(hf_config).float().eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)  # a norm whose weight were ignored would show
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    hf_model.save_pretrained(path)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    family, fields = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_hf_checkpoint(path, family, fields)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return str(path), hf_model, request.param


def test_the_checkpoint_has_what_the_case_names(saved):
    path, hf_model, name = saved
    names = {n for n, _ in hf_model.named_parameters()}
    attention = "model.layers.0.self_attn"
    assert (f"{attention}.q_norm.weight" in names) == name.startswith("qwen3")
    assert (f"{attention}.q_proj.bias" in names) == (name != "qwen3-untied")
    assert (f"{attention}.o_proj.bias" in names) == (name == "qwen3-tied-bias")
    assert ("lm_head.weight" in checkpoint_tensor_names(path)) == ("untied" in name)


def checkpoint_tensor_names(path: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", "pt") as tensors:
        return set(tensors.keys())


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("level", [0, 3])
def test_prefill_decode_mixed_and_chunked_logits_match_hf(saved, level):
    path, hf_model, _ = saved
    llm = LLM(
        path,
        compilation_config={"level": level, "backend": "eager"},
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=24,
    )
    generator = torch.Generator().manual_seed(level)
    prompt = lambda n: torch.randint(0, 256, (n,), generator=generator).tolist()  # noqa: E731
    # 5 and 11 tokens prefill together, then decode; a 30-token prompt arrives later and is
    # chunked by the 24-token budget while the first two decode (mixed batches).
    compared = run_and_compare(
        llm, hf_model, [prompt(5), prompt(11)], steps=3, late_prompts=[prompt(30)]
    )
    assert compared == 3 * 3  # every produced token of every request was checked


PROMPTS = [[3, 17, 92, 5], [200, 1, 44, 9, 61, 7, 250]]
MAX_TOKENS = 6


def assert_greedy_tokens_equal_hf(saved, mode: str) -> None:
    path, hf_model, _ = saved
    assert greedy_tokens(path, mode, PROMPTS, MAX_TOKENS, max_num_seqs=2) == [
        hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in PROMPTS
    ]


@pytest.mark.platform_agnostic
def test_greedy_tokens_equal_hf_generate(saved):
    assert_greedy_tokens_equal_hf(saved, "eager")


# Graphs for one checkpoint of each architecture (the graphs do not depend on the variant).
@pytest.mark.platform_agnostic
@pytest.mark.parametrize("saved", ["qwen2-untied", "qwen3-tied-bias"], indirect=True)
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_greedy_tokens_equal_hf_generate_with_graphs(saved, mode, graph_platform):
    assert_greedy_tokens_equal_hf(saved, mode)


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=True"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
    ],
)
def test_sliding_window_is_refused_with_the_field_named(family, fields, named):
    hf_config = getattr(transformers, f"{family}Config")(**SHAPE, **fields).to_dict()
    hf_config["architectures"] = [f"{family}ForCausalLM"]
    with pytest.raises(ModelConfigError, match=named) as error:
        check_hf_config(hf_config)
    assert "not implemented" in str(error.value)


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
def test_a_config_with_sliding_window_off_passes(family):
    # transformers writes max_window_layers and layer_types; Qwen2.5's config.json also gives
    # sliding_window a size while use_sliding_window is false
    hf_config = getattr(transformers, f"{family}Config")(**SHAPE).to_dict()
    hf_config.update(architectures=[f"{family}ForCausalLM"], sliding_window=131072)
    assert hf_config["use_sliding_window"] is False and "layer_types" in hf_config
    assert check_hf_config(hf_config) == f"{family}ForCausalLM"


def test_fp8_is_refused_with_a_clear_error(saved):
    path, _, _ = saved
    with pytest.raises(ValueError, match="quantization='fp8' is implemented for LlamaForCausalLM"):
        LLM(path, quantization="fp8", compilation_config={"level": 0}, dtype="float32")
