"""Qwen3.5 text logits and greedy tokens equal HF transformers' ``Qwen3_5ForCausalLM`` (float32).

A tiny random checkpoint saved by transformers itself (``Qwen3_5TextConfig``, layers Gated
DeltaNet, gated attention, Gated DeltaNet; value heads twice the key heads; a quarter of each
attention head rotated; attention biases on), with its norms, biases, ``A_log`` and ``dt_bias``
drawn at random so that a dropped one would show. Logits of prefills, decodes, mixed steps and a
chunked prefill whose chunks (22, 22, 2) carry the conv window and the recurrent state across
steps are within SPEC §4's tolerance (max |diff| <= 1e-4 * max |HF logit|) at levels 0 and 3;
greedy tokens of a batch of mixed lengths (one a one-token prompt) equal ``generate``'s eagerly
and with PIECEWISE, FULL_AND_PIECEWISE and breakable graphs (simgraph where the platform has
none, so the ``gated_delta_net`` op is split around, held in FULL decode graphs and broken at);
the graph splits at each ``gated_delta_net`` and attention (exact counters); a preempted request,
recomputed, gives the same tokens; the same weights as a vision-language checkpoint
(``Qwen3_5ForConditionalGeneration``: nested ``text_config``, ``model.language_model.*``, with
``model.visual.*`` tensors) load and give the same tokens.
Run: pytest tests/models/test_qwen3_5_hf.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.config_checks import ModelConfigError, check_hf_config
from pieceworks.models.loading.hf_directory import save_hf_directory
from pieceworks.sampling_params import SamplingParams
from tests.models.hf_reference import greedy_tokens, hf_greedy
from tests.models.test_bamba_hf import make_llm, prompt_maker, run_and_compare

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "attention_bias": True,
    "max_position_embeddings": 256,
}


def hf_config_dict(**fields) -> dict:
    hf_config = transformers.Qwen3_5TextConfig(**{**SHAPE, **fields}).to_dict()
    hf_config["architectures"] = ["Qwen3_5ForCausalLM"]
    return hf_config


def save_hf_checkpoint(path) -> object:
    """A random ``Qwen3_5ForCausalLM`` saved by transformers; returns HF's model of it."""
    hf_config = transformers.Qwen3_5TextConfig(**SHAPE)
    hf_config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    hf_model = transformers.Qwen3_5ForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.normal_(1.0, 0.3)  # gated norm: weight
            elif "norm" in name:
                param.normal_(0.0, 0.3)  # zero-centred norms: 1 + weight
            elif name.endswith(("bias", ".dt_bias")):
                param.normal_(0.0, 0.5)
            elif name.endswith(".A_log"):
                param.uniform_(-1.0, 1.5)
    hf_model.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return str(path), save_hf_checkpoint(path)


def test_the_checkpoint_has_both_mixers_and_a_partial_rotary(saved):
    _, hf_model = saved
    names = {name for name, _ in hf_model.named_parameters()}
    assert {
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.0.linear_attn.A_log",
    } <= names
    assert {
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.self_attn.o_proj.bias",
    } <= names
    assert hf_model.config.rope_parameters["partial_rotary_factor"] == 0.25
    assert hf_model.model.layers[1].self_attn.q_proj.out_features == 2 * 4 * 16  # query + gate


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
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise", "breakable"])
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


def test_a_vision_language_checkpoint_loads_its_text_model(saved, hf_tokens, tmp_path, caplog):
    """``Qwen3_5ForConditionalGeneration`` as published: the text model's fields under
    ``text_config``, its weights under ``model.language_model``, the vision tower's tensors
    skipped with one log line."""
    from safetensors.torch import load_file

    path, _ = saved
    tensors = load_file(f"{path}/model.safetensors")
    renamed = {name.replace("model.", "model.language_model.", 1): t for name, t in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    text_config = {k: v for k, v in hf_config_dict().items() if k != "architectures"}
    vision_language_config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text_config, "tie_word_embeddings": True},  # the top level's is read
        "vision_config": {"depth": 1, "hidden_size": 16},
        "tie_word_embeddings": False,
    }
    save_hf_directory(renamed, vision_language_config, tmp_path)
    with caplog.at_level("INFO", logger="pieceworks.models.qwen3_5"):
        assert model_greedy_tokens(str(tmp_path), "eager") == hf_tokens
    assert sum("vision tower" in record.message for record in caplog.records) == 1


@pytest.mark.platform_agnostic
def test_the_graph_splits_at_each_gated_delta_net_and_attention(saved, graph_platform):
    """``gated_delta_net`` is a dynamic splitting op, as ``mamba_mixer2`` is."""
    from pieceworks.core.counters import compilation_counter
    from pieceworks.core.custom_op import is_dynamic_op

    num_layers = len(SHAPE["layer_types"])  # one split op each: attention or gated_delta_net
    # Pieces: 2 * 3 + 1 = 7, the 3 + 1 runs between split ops capturable. max_num_seqs 4 gives
    # capture sizes 1, 2, 4, 8: FULL decode graphs (each with its decode tail and masked tail)
    # for the three sizes <= 4, and PIECEWISE graphs of every capturable piece for all four sizes.
    with compilation_counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=2 * num_layers + 1,
        num_piecewise_capturable_graphs_seen=num_layers + 1,
        num_gpu_runner_capture_triggers=1,
        num_cudagraph_captured=3 * 3 + 4 * (num_layers + 1),
        num_decode_tails_captured=3 + 3,
    ):
        LLM(
            saved[0],
            compilation_config=compilation_for_mode("full_and_piecewise", {"backend": "eager"}),
            dtype="float32",
            max_num_seqs=4,
        )
    assert is_dynamic_op("pieceworks::gated_delta_net")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"layer_types": ["linear_attention", "sliding_attention", "full_attention"]},
            "layer_types=",
        ),
        ({"hidden_act": "gelu"}, "hidden_act="),
    ],
)
def test_unimplemented_fields_are_refused_by_name(fields, named):
    hf_config = hf_config_dict()
    hf_config.update(fields)
    with pytest.raises(ModelConfigError, match=named):
        check_hf_config(hf_config)


def test_the_default_config_passes():
    hf_config = transformers.Qwen3_5TextConfig().to_dict()
    hf_config["architectures"] = ["Qwen3_5ForCausalLM"]
    assert check_hf_config(hf_config) == "Qwen3_5ForCausalLM"
