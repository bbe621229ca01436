"""``OutputProcessor`` without a tokenizer: the output objects a caller reads, field by field.

Proves: a prompt's ``RequestOutput`` carries its id, prompt, prompt ids and one
``CompletionOutput`` per completion with its index, token ids, finish and stop reasons, and,
when asked, its per-token logprob dicts (the top-k ranked 1.., the chosen token added when it is
not among them) and their sum; prompt logprobs start with None; the streamed deltas add up to
the final token ids, carry the prompt's id and the completion's index, and only the last of each
has a finish reason; ``n=2`` queues two engine requests ``<id>-0`` and ``<id>-1``; a stop token
id is the completion's ``stop_reason``; a reused request id is refused with its message; an
aborted prompt is forgotten. llama-tiny at level 0 on CPU, float32.
Run: pytest tests/engine/test_output_processor.py
"""

from __future__ import annotations

import math

import pytest

from pieceworks.engine.llm import LLM
from pieceworks.engine.output_processor import CompletionDelta, Logprob, OutputProcessor
from pieceworks.sampling_params import SamplingParams

PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def llm():
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=4)


def run(processor: OutputProcessor, stream: bool = True) -> list[CompletionDelta]:
    deltas = []
    while processor.has_unfinished_requests():
        deltas += processor.step(stream=stream)
    return deltas


def test_streamed_deltas_add_up_to_the_output_with_every_field(llm):
    processor = OutputProcessor(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request_id = processor.add_request(PROMPT, params, prompt="the prompt", request_id="r")
    assert request_id == "r"
    deltas = run(processor)
    assert {d.request_id for d in deltas} == {"r"} and {d.index for d in deltas} == {0}
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert all(d.text == "" for d in deltas)
    output = processor.get_output("r", forget=True)
    assert output.request_id == "r" and output.prompt == "the prompt"
    assert output.prompt_token_ids == PROMPT and output.prompt_logprobs is None
    assert output.finished is True
    (completion,) = output.outputs
    assert completion.index == 0 and completion.text is None
    assert completion.token_ids == [t for d in deltas for t in d.token_ids]
    assert len(completion.token_ids) == 4
    assert completion.cumulative_logprob is None and completion.logprobs is None
    assert completion.finish_reason == "length" and completion.stop_reason is None
    with pytest.raises(KeyError):
        processor.get_output("r")  # forgotten
    default_id = processor.add_request(PROMPT, params)
    assert default_id.startswith("pw-")
    run(processor, stream=False)
    assert processor.get_output(default_id, forget=True).outputs[0].token_ids == (
        completion.token_ids
    )


def test_n_completions_are_engine_requests_of_their_own(llm):
    processor = OutputProcessor(llm.engine)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=2, seed=7)
    processor.add_request(PROMPT, params, request_id="two")
    assert sorted(processor._live) == ["two-0", "two-1"]
    deltas = run(processor)
    assert {d.request_id for d in deltas} == {"two"}
    assert sorted({d.index for d in deltas if d.finish_reason}) == [0, 1]
    output = processor.get_output("two", forget=True)
    assert [c.index for c in output.outputs] == [0, 1]
    assert all(len(c.token_ids) == 3 for c in output.outputs)
    assert all(c.finish_reason == "length" for c in output.outputs)
    for completion in output.outputs:
        streamed = [t for d in deltas if d.index == completion.index for t in d.token_ids]
        assert streamed == completion.token_ids


def test_a_stop_token_id_is_the_stop_reason(llm):
    processor = OutputProcessor(llm.engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    processor.add_request(PROMPT, greedy, request_id="free")
    run(processor)
    free = processor.get_output("free", forget=True).outputs[0].token_ids
    stop_at = free[2]
    first = free.index(stop_at)
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_at]
    )
    processor.add_request(PROMPT, params, request_id="stopped")
    deltas = run(processor)
    completion = processor.get_output("stopped", forget=True).outputs[0]
    assert completion.finish_reason == "stop" and deltas[-1].finish_reason == "stop"
    assert completion.stop_reason == stop_at
    assert completion.token_ids == free[: first + 1]


def test_logprobs_are_vllm_dicts_ranked_from_one(llm):
    processor = OutputProcessor(llm.engine)
    params = SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    processor.add_request(PROMPT, params, request_id="lp")
    run(processor)
    output = processor.get_output("lp", forget=True)
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 3
    chosen = []
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert token_id in position
        ranked = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked][:2] == [1, 2]
        assert ranked[0].logprob >= ranked[1].logprob
        assert position[token_id].rank == 1  # greedy: the chosen token is the most likely
        assert all(lp.decoded_token is None for lp in position.values())
        assert all(lp.logprob <= 0.0 for lp in position.values())
        chosen.append(position[token_id].logprob)
    assert math.isclose(completion.cumulative_logprob, sum(chosen), rel_tol=1e-6)
    prompt_logprobs = output.prompt_logprobs
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for token_id, position in zip(PROMPT[1:], prompt_logprobs[1:]):
        assert token_id in position
        assert any(lp.rank == 1 for lp in position.values())
        assert isinstance(position[token_id], Logprob)


def test_a_reused_id_is_refused_and_an_aborted_prompt_is_forgotten(llm):
    processor = OutputProcessor(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    processor.add_request(PROMPT, params, request_id="same")
    with pytest.raises(ValueError) as error:
        processor.add_request(PROMPT, params, request_id="same")
    assert str(error.value) == "request id 'same' is in use; give each request its own"
    processor.step()
    processor.abort_request("same")
    assert not processor._live
    with pytest.raises(KeyError):
        processor.get_output("same")
    run(processor)
    assert not llm.engine.has_unfinished_requests()
