"""Nemotron-H logits and greedy tokens equal HF transformers' ``NemotronHForCausalLM`` (float32).

A tiny random checkpoint saved by transformers itself (``NemotronHConfig``, layers ``M-*M-``:
Mamba2, MLP, attention, Mamba2, MLP; two SSM groups; every bias on), with its norms, biases and SSM
parameters (``A_log``, ``D``, ``dt_bias``) drawn at random so that a dropped one would show.
Logits of prefills, decodes, mixed steps and a chunked prefill whose chunks (22, 22, 2) split the
mixer's state across steps are within SPEC §4's tolerance (max |diff| <= 1e-4 * max |HF logit|)
at levels 0 and 3; greedy tokens of a batch of mixed lengths (one of them a one-token prompt)
equal ``generate``'s eagerly and with PIECEWISE and FULL_AND_PIECEWISE graphs (simgraph where
the platform has none); a preempted request, recomputed, gives the same tokens; a MoE layer and a
time-step limit are refused with the field named.
Run: pytest tests/models/test_nemotron_h_hf.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.config_checks import ModelConfigError, check_hf_config
from pieceworks.sampling_params import SamplingParams
from tests.models.hf_reference import greedy_tokens, hf_greedy
from tests.models.test_bamba_hf import make_llm, prompt_maker, run_and_compare

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "hybrid_override_pattern": "M-*M-",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "chunk_size": 8,
    "use_bias": True,
    "mlp_bias": True,
    "layer_norm_epsilon": 1e-5,
}


def hf_config_dict(**fields) -> dict:
    hf_config = transformers.NemotronHConfig(**{**SHAPE, **fields}).to_dict()
    hf_config["architectures"] = ["NemotronHForCausalLM"]
    return hf_config


def save_hf_checkpoint(path) -> object:
    """A random ``NemotronHForCausalLM`` saved by transformers; returns HF's model of it."""
    hf_config = transformers.NemotronHConfig(**SHAPE)
    hf_config.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(0)
    hf_model = transformers.NemotronHForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)  # a norm whose weight were ignored would show
            elif name.endswith("bias") or name.endswith(".D"):
                param.normal_(0.0, 0.5)
            elif name.endswith(".A_log"):  # A = -exp(A_log) in [-7.4, -0.5)
                param.uniform_(-0.7, 2.0)
    hf_model.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron-h")
    return str(path), save_hf_checkpoint(path)


def test_the_checkpoint_has_every_layer_type_and_bias(saved):
    path, hf_model = saved
    names = {name for name, _ in hf_model.named_parameters()}
    assert hf_model.config.layers_block_type == [
        "linear_attention", "mlp", "full_attention", "linear_attention", "mlp",
    ]  # fmt: skip
    assert {"model.layers.0.mixer.in_proj.bias", "model.layers.0.mixer.conv1d.bias"} <= names
    assert {"model.layers.1.mixer.up_proj.bias", "model.layers.2.mixer.q_proj.weight"} <= names
    assert "model.layers.2.mixer.q_proj.bias" not in names  # attention never has biases


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("level", [0, 3])
def test_prefill_decode_chunked_and_mixed_logits_match_hf(saved, level):
    path, hf_model = saved
    prompt = prompt_maker(level)
    # 5 and 11 tokens prefill together, then decode; a 46-token prompt arrives after the first
    # step and is chunked 22 + 22 + 2 by the 24-token budget beside two decodes.
    compared = run_and_compare(
        make_llm(path, level), hf_model, [prompt(5), prompt(11)], steps=4, late_prompts=[prompt(46)]
    )
    assert compared == 3 * 4  # every produced token of every request was checked


PROMPTS = [[7], [3, 17, 92, 5], [200, 1, 44, 9, 61, 7, 250, 13, 8, 99, 4]]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def hf_tokens(saved) -> list[list[int]]:
    return [hf_greedy(saved[1], prompt, MAX_TOKENS) for prompt in PROMPTS]


def model_greedy_tokens(path: str, mode: str) -> list[list[int]]:
    return greedy_tokens(path, mode, PROMPTS, MAX_TOKENS, max_num_seqs=4)


@pytest.mark.platform_agnostic
def test_greedy_tokens_equal_hf_generate(saved, hf_tokens):
    assert model_greedy_tokens(saved[0], "eager") == hf_tokens


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_greedy_tokens_equal_hf_generate_with_graphs(saved, hf_tokens, mode, graph_platform):
    assert model_greedy_tokens(saved[0], mode) == hf_tokens


def test_preempted_request_recomputes_its_state(saved):
    # 5 blocks of 16 tokens; two requests of 20 + 30 tokens need 4 blocks each: the newer one is
    # preempted, re-admitted with a fresh state slot and recomputed from its first token.
    path, _ = saved
    prompt = prompt_maker(2)
    batch = [prompt(20), prompt(20)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm = LLM(
        path,
        compilation_config={"level": 0},
        dtype="float32",
        max_num_seqs=2,
        num_gpu_blocks_override=5,
    )
    requests = [llm.engine.add_request(tokens, params) for tokens in batch]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert sum(request.num_preemptions for request in requests) > 0
    reference = LLM(path, compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)
    expected = [out.outputs[0].token_ids for out in reference.generate(batch, params)]
    assert [request.output_token_ids for request in requests] == expected


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hybrid_override_pattern": "M*E"}, "layers_block_type="),
        ({"time_step_limit": [0.0, 1.0]}, "time_step_limit="),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act="),
    ],
)
def test_unimplemented_fields_are_refused_by_name(fields, named):
    with pytest.raises(ModelConfigError, match=named):
        check_hf_config(hf_config_dict(**fields))


def test_a_pattern_only_config_passes():
    """Checkpoints written before transformers 5 give the layers as a pattern string only."""
    hf_config = hf_config_dict()
    del hf_config["layers_block_type"]
    hf_config.update(hybrid_override_pattern="M-*M-", num_hidden_layers=5)
    assert check_hf_config(hf_config) == "NemotronHForCausalLM"


def test_the_default_config_is_refused_for_its_moe_layer_alone():
    """``NemotronHConfig()`` has a mixture-of-experts layer; without it, it passes."""
    hf_config = transformers.NemotronHConfig().to_dict()
    hf_config["architectures"] = ["NemotronHForCausalLM"]
    with pytest.raises(ModelConfigError, match="'moe' is not implemented"):
        check_hf_config(hf_config)
    hf_config["layers_block_type"] = ["linear_attention", "full_attention", "mlp"]
    assert check_hf_config(hf_config) == "NemotronHForCausalLM"
