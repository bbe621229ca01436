"""``LLM.chat`` and ``LLM.apply_chat_template`` with a tokenizer: what reaches the engine.

Proves: a conversation is rendered by the tokenizer's chat template with the generation prompt
and queued as exactly those token ids (no second BOS), with the sampling parameters given
second, and generates what ``generate`` does for those ids, the text decoded by the tokenizer;
a list of conversations gives one output per conversation in order, each with its own
parameters; a template given third wins over the tokenizer's and ``add_generation_prompt``
(fourth) leaves the generation prompt out; ``tools`` reach the template as its ``tools`` variable.
The tokenizer is a byte-level stand-in of 256 tokens (llama-tiny's vocabulary size) built from
GGUF-style metadata and saved as an HF directory; llama-tiny, eager, float32.
Run: pytest tests/engine/test_llm_chat.py
"""

from __future__ import annotations

import pytest

from pieceworks.engine import tokenizer as tokenizer_module
from pieceworks.engine.llm import LLM
from pieceworks.engine.tokenizer import bytes_to_unicode, gguf_tokenizer
from pieceworks.sampling_params import SamplingParams
from tests.engine.test_tokenizer import CHAT_TEMPLATE, SPECIALS

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

# Every byte but 0, 1 and 2 (never in these texts): 256 tokens, llama-tiny's vocabulary.
TOKENS = [*SPECIALS, *(bytes_to_unicode()[byte] for byte in range(3, 256))]
METADATA = {
    "ggml.model": "gpt2",
    "ggml.pre": "smollm",
    "ggml.tokens": TOKENS,
    "ggml.token_type": [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)),
    "ggml.bos_token_id": 1,
    "ggml.eos_token_id": 2,
    "ggml.add_bos_token": True,
    "chat_template": CHAT_TEMPLATE,
}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def ids(text: str) -> list[int]:
    """The ids of ``text``: the special tokens whole, every other character a byte token."""
    spelling = bytes_to_unicode()
    token_ids: list[int] = []
    while text:
        special = next((s for s in SPECIALS if text.startswith(s)), None)
        if special:
            token_ids.append(TOKENS.index(special))
            text = text[len(special) :]
        else:
            token_ids += [TOKENS.index(spelling[byte]) for byte in text[0].encode()]
            text = text[1:]
    return token_ids


# The conversation as the template writes it: no BOS of the tokenizer's before it.
PROMPT = ids(
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(tokenizer_module, "gguf_tokenizer_metadata", lambda path: METADATA)
        tokenizer = gguf_tokenizer("models/tiny.gguf")
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return LLM("llama-tiny", enforce_eager=True, dtype="float32", max_num_seqs=4,
               tokenizer=str(directory))  # fmt: skip


def test_a_conversation_reaches_the_engine_as_its_template_ids(llm):
    assert llm.apply_chat_template(CONVERSATION) == PROMPT
    [output] = llm.chat(CONVERSATION, greedy(3))
    assert output.prompt_token_ids == PROMPT
    completion = output.outputs[0]
    assert len(completion.token_ids) == 3 and completion.finish_reason == "length"
    assert completion.token_ids == llm.generate([PROMPT], greedy(3))[0].outputs[0].token_ids
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_each_conversation_is_answered_in_order_with_its_own_parameters(llm):
    second = [{"role": "user", "content": "Why?"}]
    outputs = llm.chat([CONVERSATION, second], [greedy(1), greedy(4)])
    assert [o.prompt_token_ids for o in outputs] == [
        PROMPT, ids("<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
    ]  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 4]


def test_a_given_template_wins_and_the_generation_prompt_can_be_left_out(llm):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    template += "{% if add_generation_prompt %}assistant:{% endif %}"
    [with_prompt] = llm.chat(CONVERSATION, greedy(1), template)
    assert with_prompt.prompt_token_ids == ids("system: Be brief.\nuser: Hi!\nassistant:")
    [without] = llm.chat(CONVERSATION, greedy(1), template, False)
    assert without.prompt_token_ids == ids("system: Be brief.\nuser: Hi!\n")
    [own_template] = llm.chat(CONVERSATION, greedy(1), add_generation_prompt=False)
    assert own_template.prompt_token_ids == PROMPT[: -len(ids("<|im_start|>assistant\n"))]


def test_tools_reach_the_template_as_its_tools_variable(llm):
    template = "{% for t in tools or [] %}tool {{ t['function']['name'] }}\n{% endfor %}"
    template += "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tools = [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}},
    ]
    [output] = llm.chat(CONVERSATION, greedy(1), template, tools=tools)
    assert output.prompt_token_ids == ids("tool weather\ntool time\nsystem: Be brief.\nuser: Hi!\n")
    [no_tools] = llm.chat(CONVERSATION, greedy(1), template)
    assert no_tools.prompt_token_ids == ids("system: Be brief.\nuser: Hi!\n")
