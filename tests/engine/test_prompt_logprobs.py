"""Prompt log-probabilities end to end on llama-tiny (eager, CPU): the values of transformers.

Proves: with ``prompt_logprobs=k`` and no ``logprobs``, every prompt position after the first
carries the log-probability and rank of its own token under the logits of the position before,
and the ``k`` most likely tokens, as transformers computes them; position 0 is None and there
is one entry per prompt token, however the prompts were split into chunks and batched together.
Run: pytest tests/engine/test_prompt_logprobs.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import random_hf_checkpoint
from pieceworks.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
TOP = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama-tiny")
    random_hf_checkpoint("llama-tiny", path, seed=3, dtype=torch.float32)
    return str(path)


def hf_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """(len(prompt), V): log_softmax of the logits at each prompt position."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def test_prompt_logprobs_equal_transformers_across_chunks_and_requests(checkpoint):
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 23)]
    # 16 tokens a step: the long prompt is prefilled in two chunks, the first beside the short.
    llm = LLM(checkpoint, compilation_config={"level": 0}, dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=16)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        positions = output.prompt_logprobs
        assert len(positions) == len(prompt) and positions[0] is None
        assert output.outputs[0].logprobs is None  # only the prompt's were asked for
        reference = hf_logprobs(checkpoint, prompt)
        for index, token_id in enumerate(prompt[1:], 1):
            expected = reference[index - 1]
            entry = positions[index][token_id]
            assert entry.logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
            assert entry.rank == int((expected > expected[token_id]).sum()) + 1
            top = sorted(positions[index].items(), key=lambda item: item[1].rank)[:TOP]
            assert [tid for tid, _ in top] == expected.topk(TOP).indices.tolist()
