"""Speculative decoding on a GPU: compiled FULL_AND_PIECEWISE graphs keep the target's tokens.

- The trained SmolLM2 (float32, Inductor, FULL_AND_PIECEWISE on the device) with n-gram
  speculation gives HF transformers' greedy tokens (float32 on the CPU, the same GGUF) for a
  passage it is asked to copy (``bench latency --prompt-kind copy``: proposals are accepted) and
  a chat question; proposals were accepted.
- A draft model equal to the target (a tiny random llama, weights scaled so its text depends on
  the context) accepts every proposal (a single float32 near-tie between the draft's one-token
  step and the target's verify allowed), gives the tokens of decoding without speculation,
  verify steps replay the FULL graph captured for ``k + 1`` query tokens per sequence, and a
  second generation after the warm-up compiles, traces and captures nothing.

Run on a GPU machine: pytest -m gpu tests/engine/test_spec_decode_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.benchmarks.prompts import copy_prompt
from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.engine.llm import LLM
from pieceworks.models.loading import sources
from pieceworks.platforms import current_platform
from pieceworks.sampling_params import SamplingParams
from tests.engine.test_host_path import save_scaled_llama_tiny

pytestmark = pytest.mark.gpu

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4}
NGRAM["prompt_lookup_min"] = 2
MAX_TOKENS = 48
_COUNTED = ("num_dynamo_traces", "num_backend_compilations", "num_inductor_compiles")
_COUNTED += ("num_eager_compiles", "num_cudagraph_captured")


def release(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    current_platform().empty_cache()


def hf_greedy(prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers' greedy tokens (float32, CPU, EOS ignored) from the same GGUF."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    path = sources.smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # always MAX_TOKENS tokens, as ignore_eos
    tokens = []
    for prompt in prompts:  # one at a time: no padding, so nothing but the prompt is attended
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        tokens.append(out[0, len(prompt) :].tolist())
    assert all(len(t) == MAX_TOKENS for t in tokens)  # no EOS stop: as ignore_eos
    return tokens


def test_smollm2_with_ngram_speculation_gives_transformers_greedy_tokens():
    if not sources.is_smollm2_installed():
        pytest.skip(f"needs the trained model: {sources.SMOLLM2_INSTALL_COMMAND}")
    llm = LLM(
        sources.SMOLLM2_NAME,
        compilation_config=compilation_for_mode("full_and_piecewise"),
        dtype="float32",
        max_num_seqs=4,
        max_model_len=512,
        speculative_config=NGRAM,
    )
    assert not torch.backends.cuda.matmul.allow_tf32
    question = [{"role": "user", "content": "Name three primary colors."}]
    from pieceworks.engine.tokenizer import apply_chat_template

    prompts = [copy_prompt(llm.tokenizer, 200), apply_chat_template(llm.tokenizer, question)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    stats = llm.engine.scheduler.spec_decoding_stats
    release(llm)
    assert stats.num_accepted_tokens > 0
    assert tokens == hf_greedy(prompts)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_scaled_llama_tiny(tmp_path_factory.mktemp("llama-tiny"))


def tiny_llm(checkpoint: str, draft: bool) -> LLM:
    spec = {"method": "draft_model", "model": checkpoint, "num_speculative_tokens": K}
    return LLM(
        checkpoint,
        compilation_config=compilation_for_mode("full_and_piecewise"),
        dtype="float32",
        max_num_seqs=4,
        num_gpu_blocks_override=64,  # the draft's KV cache: the same count, beside the target's
        speculative_config=spec if draft else None,
    )


def test_a_draft_equal_to_the_target_accepts_everything_without_recompiles(checkpoint):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 12, 9)]
    later = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (7, 3, 15, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain_llm = tiny_llm(checkpoint, draft=False)  # the same two calls: the same batches
    plain = [
        o.outputs[0].token_ids
        for batch in (prompts, later)
        for o in plain_llm.generate(batch, params)
    ]
    release(plain_llm)

    llm = tiny_llm(checkpoint, draft=True)
    planned, plan = [], llm.engine.runner.plan
    llm.engine.runner.plan = lambda output: planned.append((output, plan(output))) or plan(output)
    warm = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # the warm-up
    before = compilation_counter.clone()
    after_warmup = [o.outputs[0].token_ids for o in llm.generate(later, params)]
    stats = llm.engine.scheduler.spec_decoding_stats
    release(llm)

    assert warm + after_warmup == plain
    for name in _COUNTED:  # nothing traced, compiled or captured once warm
        assert getattr(compilation_counter, name) == getattr(before, name), name
    assert stats.num_draft_tokens > 0
    assert stats.num_draft_tokens - stats.num_accepted_tokens <= 1, stats.as_dict()
    verify_modes = {
        (mode, getattr(descriptor, "uniform_query_len", None))
        for output, (_, mode, descriptor) in planned
        if output.uniform_decode_query_len == K + 1
    }
    assert (CUDAGraphMode.FULL, K + 1) in verify_modes
