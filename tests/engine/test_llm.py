"""``LLM.generate`` and ``LLM.stream`` without a tokenizer: results, order and clean-up.

Proves: ``generate`` returns one ``RequestOutput`` per prompt in prompt order, each with its own
parameters' token count, the prompt ids and no text; ``stream`` yields deltas whose ids are
those of the prompts in order and whose tokens concatenate to ``generate``'s; closing a stream
early aborts what is left, so the engine is idle and the next call runs alone; a call
interrupted by an error aborts its requests; the bad-conversation message is given in full;
a preset has no tokenizer, so text prompts and chat are refused with the whole message and
nothing is queued.
llama-tiny at level 0 on CPU, float32.
Run: pytest tests/engine/test_llm.py
"""

from __future__ import annotations

import pytest

from pieceworks.engine.llm import LLM, _conversations
from pieceworks.sampling_params import SamplingParams

PROMPTS = [[3, 14, 15], [92, 65], [35, 89, 79, 32]]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=4)


def test_generate_returns_each_prompt_in_order_with_its_own_parameters(llm):
    outputs = llm.generate(PROMPTS, [greedy(2), greedy(5), greedy(3)])
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 5, 3]
    assert all(o.finished and o.prompt is None for o in outputs)
    assert all(o.outputs[0].text is None for o in outputs)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert len({o.request_id for o in outputs}) == 3
    alone = llm.generate([PROMPTS[1]], greedy(5))[0].outputs[0].token_ids
    assert alone == outputs[1].outputs[0].token_ids  # greedy: the batch does not change it
    assert not llm.processor._prompts and not llm.engine.has_unfinished_requests()


def test_stream_deltas_name_the_prompts_and_add_up_to_generate(llm):
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(4))]
    deltas = list(llm.stream(PROMPTS, greedy(4)))
    ids = list(dict.fromkeys(d.request_id for d in deltas))
    assert len(ids) == 3
    tokens = [[t for d in deltas if d.request_id == rid for t in d.token_ids] for rid in ids]
    assert tokens == expected
    assert sum(1 for d in deltas if d.finish_reason == "length") == 3
    assert not llm.processor._prompts


def test_closing_a_stream_early_aborts_the_rest(llm):
    stream = llm.stream(PROMPTS, greedy(200))
    first = next(stream)
    assert first.token_ids and first.finish_reason is None
    stream.close()
    assert not llm.engine.scheduler.has_unfinished_requests()  # only a launched step's tokens
    assert not llm.processor._prompts and not llm.processor._live
    outputs = llm.generate([PROMPTS[0]], greedy(2))
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 2


def test_an_interrupted_generate_aborts_its_requests(llm, monkeypatch):
    calls = []
    step = llm.processor.step

    def failing_step(stream: bool = True):
        calls.append(stream)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step(stream)

    monkeypatch.setattr(llm.processor, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(50))
    assert calls == [False, False]  # generate steps without streaming
    monkeypatch.undo()
    assert not llm.engine.scheduler.has_unfinished_requests()
    assert not llm.processor._prompts


def test_a_bad_conversation_is_refused_with_the_whole_message():
    with pytest.raises(ValueError) as error:
        _conversations([{"role": "user", "content": "hi"}, "hi"])
    assert str(error.value) == (
        "messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} "
        "dicts) or a list of such conversations"
    )
    conversation = ({"role": "user", "content": "hi"},)
    assert _conversations(conversation) == [list(conversation)]
    assert _conversations([list(conversation), list(conversation)]) == [list(conversation)] * 2


def test_without_a_tokenizer_text_and_chat_are_refused_with_the_whole_message(llm):
    assert llm.tokenizer is None and llm.processor.tokenizer is None
    for prompt, where in (("hello", "prompt 0"), ({"prompt": "hello"}, "prompt 1")):
        with pytest.raises(ValueError) as error:
            llm.generate([PROMPTS[0], prompt] if where == "prompt 1" else [prompt], greedy(1))
        assert str(error.value) == (
            f"{where} is text, which needs a tokenizer; this model has none (presets have "
            "random weights): pass token ids instead"
        )
    with pytest.raises(ValueError) as error:
        llm.chat([{"role": "user", "content": "hi"}], greedy(1))
    assert str(error.value) == (
        "chat needs a tokenizer with a chat template; this model has no tokenizer (presets have "
        "random weights): use a model directory or GGUF file with one"
    )
    assert not llm.engine.scheduler.has_unfinished_requests() and not llm.processor._prompts
    [output] = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(2))
    assert output.prompt_token_ids == PROMPTS[1] and output.outputs[0].text is None
