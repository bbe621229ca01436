"""Prompts and sampling parameters are checked before any request is queued.

``parse_prompts`` accepts vLLM's prompt forms and refuses the rest with a message naming the
prompt; through ``LLM.generate`` a bad prompt anywhere in a batch (a token outside the vocabulary,
a prompt longer than ``max_model_len``) raises with nothing queued, and the next call returns
only its own results in as many steps as it needs itself; an interrupted call aborts its requests,
and a finished stream leaves no output behind; ``chat`` takes one conversation or a list of them.
Run: pytest tests/engine/test_inputs.py
"""

from __future__ import annotations

import pytest

from pieceworks.engine.inputs import PromptError, parse_prompts, sampling_params_for
from pieceworks.engine.llm import LLM, _conversations
from pieceworks.sampling_params import SamplingParams

VOCAB = 256  # llama-tiny
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def encode(text: str) -> list[int]:
    return [ord(c) % VOCAB for c in text]


def test_vllm_prompt_forms_are_accepted():
    parsed = parse_prompts(
        [[1, 2], {"prompt_token_ids": [3, 4]}, {"prompt": "ab"}, "cd", (5,)],
        encode=encode,
        vocab_size=VOCAB,
    )
    assert [p.token_ids for p in parsed] == [[1, 2], [3, 4], [97, 98], [99, 100], [5]]
    assert [p.text for p in parsed] == [None, None, "ab", "cd", None]
    assert [p.token_ids for p in parse_prompts({"prompt_token_ids": [7]})] == [[7]]
    assert [p.token_ids for p in parse_prompts("e", encode=encode)] == [[101]]
    assert parse_prompts([]) == []
    assert [p.token_ids for p in parse_prompts([[0, VOCAB - 1]], vocab_size=VOCAB)] == [[0, 255]]


def test_chat_takes_one_conversation_or_a_list_of_them():
    first, second = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]
    assert _conversations(first) == [first]
    assert _conversations([first, second]) == [first, second]
    for bad in ([], [first, []], ["hi"]):
        with pytest.raises(ValueError, match="messages must be a conversation"):
            _conversations(bad)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([1, 2, 3], "flat list of token ids; generate takes a list of prompts: pass [[1, 2, 3]]"),
        ([["a"]], "prompt 0: token ids must be ints; position 0 holds 'a' (str)"),
        ([[1, 2], [1.0, 2.0]], "prompt 1: token ids must be ints; position 0 holds 1.0 (float)"),
        ([[1, True]], "prompt 0: token ids must be ints; position 1 holds True (bool)"),
        ([[1, 2], [3, 4], [300]], "prompt 2: token id 300 at position 0 is outside"),
        ([[1], [-1]], "prompt 1: token id -1 at position 0 is outside this model's vocabulary"),
        ([[VOCAB - 1], [VOCAB]], f"prompt 1: token id {VOCAB} at position 0 is outside"),
        ([[1], []], "prompt 1 is empty; pass at least one token"),
        ([[1], ""], "prompt 1 is an empty string"),
        ([{"prompt_token_ids": []}], "prompt 0 is empty"),
        ([{"prompt": "a", "prompt_token_ids": [1]}], "exactly one of 'prompt' (text) or"),
        ([{"prompt_ids": [1]}], "got keys ['prompt_ids']"),
        ([{"prompt": [1, 2]}], "prompt 0: 'prompt' must be a string"),
        ([[1], 5], "prompt 1: token ids must be a list of ints, not 5"),
        (7, "got int"),
    ],
)
def test_bad_prompts_are_refused_naming_the_prompt(prompts, message):
    with pytest.raises(PromptError) as error:
        parse_prompts(prompts, encode=encode, vocab_size=VOCAB)
    assert message in str(error.value)


def test_text_without_a_tokenizer_is_refused():
    with pytest.raises(PromptError, match="prompt 1 is text, which needs a tokenizer"):
        parse_prompts([[1], "hello"], encode=None, vocab_size=VOCAB)


def test_sampling_params_are_one_or_one_per_prompt():
    assert sampling_params_for(None, 2) == [SamplingParams()] * 2
    assert sampling_params_for(GREEDY, 3) == [GREEDY] * 3
    with pytest.raises(PromptError, match="2 SamplingParams for 3 prompts"):
        sampling_params_for([GREEDY, GREEDY], 3)
    with pytest.raises(PromptError, match=r"sampling_params\[1\] is a dict"):
        sampling_params_for([GREEDY, {"temperature": 0}], 2)
    with pytest.raises(PromptError, match="not dict"):
        sampling_params_for({"temperature": 0}, 1)


@pytest.fixture(scope="module")
def llm():
    return LLM("llama-tiny", compilation_config={"level": 0}, max_num_seqs=4, max_model_len=64)


def _steps(llm: LLM) -> int:
    return len(llm.engine.step_seconds)


@pytest.mark.parametrize(
    ("bad_prompt", "message"),
    [
        ([300], "prompt 2: token id 300"),
        ([1] * 70, "prompt 2: request"),  # 70 + 4 tokens > max_model_len 64
        ([1.5], "prompt 2: token ids must be ints"),
    ],
)
def test_a_bad_prompt_queues_nothing_and_the_next_call_runs_alone(llm, bad_prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2] * 30, [3, 4] * 30, bad_prompt], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    steps = _steps(llm)
    results = llm.generate([[5, 6]], GREEDY)
    assert len(results) == 1
    assert results[0].prompt_token_ids == [5, 6]
    assert len(results[0].outputs[0].token_ids) == 4
    # One prefill and three decodes (plus one drain step with async scheduling): nothing else ran.
    assert _steps(llm) - steps <= 4


def test_prompt_forms_give_the_same_tokens(llm):
    by_list, by_dict = llm.generate([[9, 8, 7], {"prompt_token_ids": [9, 8, 7]}], GREEDY)
    assert by_list.outputs[0].token_ids == by_dict.outputs[0].token_ids


def test_a_finished_stream_keeps_no_output_behind(llm):
    deltas = list(llm.stream([[1, 2, 3], [4, 5]], GREEDY))
    request_ids = {delta.request_id for delta in deltas}
    assert len(request_ids) == 2 and sum(d.finish_reason is not None for d in deltas) == 2
    for request_id in request_ids:
        with pytest.raises(KeyError):
            llm.processor.get_output(request_id)  # forgotten once the stream ended


def test_an_interrupted_generate_leaves_no_request_behind(llm, monkeypatch):
    step = llm.engine.step
    calls = []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY)
    monkeypatch.undo()
    assert llm.engine.scheduler.get_num_unfinished_requests() == 0  # both were aborted
    steps = _steps(llm)
    results = llm.generate([[7, 8]], GREEDY)
    assert [r.prompt_token_ids for r in results] == [[7, 8]]
    assert _steps(llm) - steps <= 4


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (
            [1, 2],
            "prompts=[1, 2] is a flat list of token ids; generate takes a list of prompts: pass "
            '[[1, 2]] (one prompt of token ids) or [{"prompt_token_ids": [1, 2]}]',
        ),
        (
            (1, 2),
            "prompts=(1, 2) is a flat list of token ids; generate takes a list of prompts: pass "
            '[[1, 2]] (one prompt of token ids) or [{"prompt_token_ids": [1, 2]}]',
        ),
        (
            7,
            "prompts must be a string, a list of token ids in a list, a dict with 'prompt' or "
            "'prompt_token_ids', or a list of these; got int",
        ),
        ([[1], "x" * 70], None),  # text without a tokenizer: see below
        ([[1], 5], "prompt 1: token ids must be a list of ints, not 5"),
        ([[1], b"ab"], "prompt 1: token ids must be a list of ints, not b'ab'"),
        (
            [[1], set(range(30))],
            "prompt 1: token ids must be a list of ints, not "
            "{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 1...",
        ),
        ([[1], []], "prompt 1 is empty; pass at least one token"),
        ([[1], [1, "a"]], "prompt 1: token ids must be ints; position 1 holds 'a' (str)"),
        (
            [[1, VOCAB]],
            f"prompt 0: token id {VOCAB} at position 1 is outside this model's vocabulary "
            f"[0, {VOCAB})",
        ),
        ([{"prompt": 3}], "prompt 0: 'prompt' must be a string, not 3"),
        ([{"prompt": ""}], "prompt 0 is an empty string; pass some text"),
        (
            [{"prompt": "a", "extra": 1}],
            "prompt 0: a dict prompt takes exactly one of 'prompt' (text) or "
            "'prompt_token_ids'; got keys ['extra', 'prompt']",
        ),
        (
            [{}],
            "prompt 0: a dict prompt takes exactly one of 'prompt' (text) or "
            "'prompt_token_ids'; got keys []",
        ),
    ],
)
def test_every_prompt_refusal_message_in_full(prompts, message):
    with pytest.raises(PromptError) as error:
        parse_prompts(prompts, encode=None, vocab_size=VOCAB)
    if message is None:
        message = (
            "prompt 1 is text, which needs a tokenizer; this model has none (presets have random "
            "weights): pass token ids instead"
        )
    assert str(error.value) == message


def test_every_sampling_params_refusal_message_in_full():
    with pytest.raises(PromptError) as error:
        sampling_params_for({"temperature": 0}, 1)
    assert str(error.value) == (
        "sampling_params must be a SamplingParams or a list of them (one per prompt), not dict"
    )
    with pytest.raises(PromptError) as error:
        sampling_params_for([GREEDY, GREEDY, 3], 3)
    assert str(error.value) == "sampling_params[2] is a int, not a SamplingParams"
    with pytest.raises(PromptError) as error:
        sampling_params_for((GREEDY, GREEDY), 3)
    assert str(error.value) == "2 SamplingParams for 3 prompts; pass one, or one per prompt"
    assert sampling_params_for((GREEDY, SamplingParams()), 2) == [GREEDY, SamplingParams()]
    assert sampling_params_for(GREEDY, 0) == []


def test_accepted_forms_keep_their_text_and_ids():
    parsed = parse_prompts(({"prompt": "hi"}, (1, 2)), encode=encode, vocab_size=None)
    assert [(p.text, p.token_ids) for p in parsed] == [("hi", [104, 105]), (None, [1, 2])]
    assert parse_prompts([[10**6]], vocab_size=None)[0].token_ids == [10**6]  # no vocabulary
    assert parse_prompts({"prompt": "a"}, encode=encode)[0].text == "a"
