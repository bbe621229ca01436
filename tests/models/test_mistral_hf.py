"""Mistral logits and greedy tokens equal HF transformers' on checkpoints it saved.

Each checkpoint is a tiny random ``MistralForCausalLM`` built and saved by transformers itself
(``MistralConfig``, float32, norms drawn at random): one with ``sliding_window`` 8, smaller than
the prompts (20 and 30 tokens) so that every layer masks keys older than the window, GQA and
``head_dim`` unrelated to ``hidden_size``; one with ``sliding_window`` null (full attention), tied.
Logits of prefill, decode, a mixed batch and a chunked prefill are within SPEC §4's tolerance
(max |diff| <= 1e-4 * max |HF logit|) at levels 0 and 3; greedy tokens equal ``generate``'s
eagerly and with PIECEWISE and FULL_AND_PIECEWISE graphs (the simgraph platform where the
resolved one has no graphs); with the window, a KV cache of 6 blocks of 4 tokens forces
preemption while the scheduler frees blocks before each request's window, and the tokens stay
HF's; the window reaches the scheduler only when every layer has one; an absent
``sliding_window`` is 4096, as ``MistralConfig`` reads it.
Run: pytest tests/models/test_mistral_hf.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.config_checks import ModelConfigError, check_hf_config
from pieceworks.models.mistral import mistral_sliding_window
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.block_manager import BlockManager
from tests.models.hf_reference import greedy_tokens, hf_greedy
from tests.models.test_llama_hf import run_and_compare

transformers = pytest.importorskip("transformers")

WINDOW = 8
SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}
CONFIGS = {
    "window": {"sliding_window": WINDOW, "head_dim": 32, "tie_word_embeddings": False},
    "full-tied": {"sliding_window": None, "tie_word_embeddings": True},
}


def save_hf_checkpoint(path, fields: dict) -> None:
    """A random ``MistralForCausalLM`` saved by transformers, its norms drawn at random."""
    hf_config = transformers.MistralConfig(**SHAPE, **fields)
    hf_config.architectures = ["MistralForCausalLM"]
    torch.manual_seed(0)
    hf_model = transformers.MistralForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)  # a norm whose weight were ignored would show
    hf_model.save_pretrained(path)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_hf_checkpoint(path, CONFIGS[request.param])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return str(path), hf_model, request.param


def random_prompt(generator: torch.Generator, num_tokens: int) -> list[int]:
    return torch.randint(0, 256, (num_tokens,), generator=generator).tolist()


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("level", [0, 3])
def test_prefill_decode_mixed_and_chunked_logits_match_hf(saved, level):
    path, hf_model, name = saved
    llm = LLM(
        path,
        compilation_config={"level": level, "backend": "eager"},
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=24,
    )
    assert llm.engine.scheduler.sliding_window == CONFIGS[name]["sliding_window"]
    generator = torch.Generator().manual_seed(level)
    # 5 and 20 tokens prefill together, then decode; a 30-token prompt arrives later and is
    # chunked by the 24-token budget while the first two decode (mixed batches). The 20- and
    # 30-token contexts exceed the window of 8, and the second chunk's first query (position 24)
    # no longer sees block 0 (positions 0-15), which the scheduler has freed by then.
    prompts = [random_prompt(generator, 5), random_prompt(generator, 20)]
    late = [random_prompt(generator, 30)]
    compared = run_and_compare(llm, hf_model, prompts, steps=3, late_prompts=late)
    assert compared == 3 * 3  # every produced token of every request was checked


PROMPTS = [[3, 17, 92, 5, 8, 1, 44, 9, 61, 7, 250, 13], [200, 1, 44, 9, 61, 7, 250, 3, 4, 5, 6]]
MAX_TOKENS = 6


def assert_greedy_tokens_equal_hf(saved, mode: str) -> None:
    path, hf_model, _ = saved
    assert greedy_tokens(path, mode, PROMPTS, MAX_TOKENS, max_num_seqs=2) == [
        hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in PROMPTS
    ]


@pytest.mark.platform_agnostic
def test_greedy_tokens_equal_hf_generate(saved):
    assert_greedy_tokens_equal_hf(saved, "eager")


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("saved", ["window"], indirect=True)
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_greedy_tokens_equal_hf_generate_with_graphs(saved, mode, graph_platform):
    assert_greedy_tokens_equal_hf(saved, mode)


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("saved", ["window"], indirect=True)
def test_preemption_with_freed_blocks_keeps_hf_tokens(saved):
    """6 blocks of 4 tokens: three requests of 5 + 12 tokens start together and, as they grow,
    preempt one another although each frees the blocks before its window of 8 as it decodes
    (about 3 live blocks each)."""
    path, hf_model, _ = saved
    llm = LLM(
        path,
        compilation_config={"level": 0},
        dtype="float32",
        max_num_seqs=3,
        block_size=4,
        num_gpu_blocks_override=6,
        max_model_len=64,
    )
    prompts = [PROMPTS[0][:5], PROMPTS[1][:5], PROMPTS[1][::-1][:5]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine, preempted, freed = llm.engine, 0, False
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        preempted = max(preempted, *(r.num_preemptions for r in requests))
        freed |= any(BlockManager.FREED_BLOCK_ID in r.block_ids for r in requests)
    assert preempted > 0 and freed
    assert [list(r.output_token_ids) for r in requests] == [
        hf_greedy(hf_model, prompt, 12) for prompt in prompts
    ]
    assert engine.scheduler.block_manager.num_free_blocks == 6  # nothing leaked


def test_absent_sliding_window_is_mistral_config_default():
    hf_config = transformers.MistralConfig(**SHAPE).to_dict()
    assert mistral_sliding_window(hf_config) == hf_config["sliding_window"] == 4096
    del hf_config["sliding_window"]
    assert mistral_sliding_window(hf_config) == transformers.MistralConfig().sliding_window
    assert mistral_sliding_window({**hf_config, "sliding_window": None}) is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"sliding_window": 0}, "sliding_window=0"), ({"hidden_act": "gelu"}, "hidden_act='gelu'")],
)
def test_unsupported_fields_are_refused_with_the_field_named(fields, named):
    hf_config = {**transformers.MistralConfig(**SHAPE).to_dict(), **fields}
    hf_config["architectures"] = ["MistralForCausalLM"]
    with pytest.raises(ModelConfigError, match=named):
        check_hf_config(hf_config)
