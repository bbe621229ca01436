"""``pieceworks chat`` and ``generate`` flags that do not fit, and Ctrl-C in ``chat``.

Proves: Ctrl-C during an answer stops it (its request is aborted, the engine is idle), keeps the
partial answer and returns to the prompt; Ctrl-C at the prompt ends the loop without a traceback;
``chat -n 2`` and ``generate --chat --token-ids`` are one ``error:`` line each, before any model
is built. llama-tiny at level 0 on CPU (its token ids stand in for text).
Run: pytest tests/entrypoints/test_chat_cli.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Iterator
from typing import Any

import pytest

from pieceworks.engine.llm import LLM
from pieceworks.entrypoints.chat import chat_loop
from pieceworks.sampling_params import SamplingParams
from tests.entrypoints.test_cli_errors import expect_error

PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


class TinyChat:
    """``LLM``'s chat surface over llama-tiny: a fixed prompt, each token's id as its text."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def apply_chat_template(self, conversation: list[dict[str, str]]) -> list[int]:
        return [3, 14, 15]

    def stream(self, prompts: Any, params: Any) -> Iterator[Any]:
        with contextlib.closing(self.llm.stream(prompts, params)) as deltas:
            for delta in deltas:
                yield dataclasses.replace(delta, text=f"<{delta.token_ids[0]}>")


class InterruptedOutput(io.StringIO):
    """A terminal where Ctrl-C arrives while the third piece of an answer is written."""

    def __init__(self) -> None:
        super().__init__()
        self.num_pieces = 0

    def write(self, text: str) -> int:
        if text.startswith("<"):
            self.num_pieces += 1
            if self.num_pieces == 3:
                raise KeyboardInterrupt
        return super().write(text)


class CtrlCAtPrompt(io.StringIO):
    def readline(self, *args: Any) -> str:
        raise KeyboardInterrupt


@pytest.fixture(scope="module")
def llm():
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)


def test_ctrl_c_during_an_answer_stops_it_and_returns_to_the_prompt(llm):
    out = InterruptedOutput()
    chat_loop(TinyChat(llm), PARAMS, None, io.StringIO("hello\nagain\n"), out)
    first, second = out.getvalue().splitlines()
    assert first.endswith("[interrupted]") and first.count("<") == 2
    assert second.endswith("[interrupted]") is False and second.count("<") == 32
    assert not llm.engine.has_unfinished_requests()


def test_ctrl_c_at_the_prompt_ends_the_loop(llm):
    out = io.StringIO()
    chat_loop(TinyChat(llm), PARAMS, None, CtrlCAtPrompt(), out)
    assert out.getvalue() == "\n"


def test_chat_refuses_more_than_one_answer_per_turn(capsys):
    expect_error(capsys, ["chat", "--model", "llama-tiny", "-n", "2"], "-n 2", "-n must be 1")


def test_generate_refuses_chat_with_token_ids(capsys):
    argv = ["generate", "--model", "llama-tiny", "--chat", "--token-ids", "1,2,3"]
    expect_error(capsys, argv, "--chat and --token-ids do not go together")
