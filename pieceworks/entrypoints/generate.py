"""``pieceworks generate``: generate from prompts given on the command line."""

from __future__ import annotations

import argparse
from typing import Any

from pieceworks.entrypoints.engine_args import (
    add_engine_args,
    compilation_fields,
    default_model,
    engine_args,
)


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate from prompts given as text (needs a tokenizer) or comma-separated token ids."""
    from pieceworks.engine.llm import LLM
    from pieceworks.engine.sampling_params import SamplingParams

    prompts: list[Any] = [
        text_arg(text, index) if args.text else token_ids_arg(text, index)
        for index, text in enumerate(args.prompts)
    ]
    params = SamplingParams(  # checked before the model is built
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    llm = LLM(args.model, compilation_config=compilation_fields(args) or None, **engine_args(args))
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        shown = completion.text if completion.text is not None else completion.token_ids
        print(f"[{output.request_id}] ({completion.finish_reason}) {shown}")
    return 0


def text_arg(text: str, index: int) -> str:
    """A command-line text prompt; it must not be empty."""
    if not text.strip():
        raise ValueError(f"prompt {index} is empty; pass some text")
    return text


def token_ids_arg(text: str, index: int) -> list[int]:
    """A command-line prompt of comma-separated token ids, e.g. ``1,2,3``."""
    pieces = [piece.strip() for piece in text.split(",")]
    if not all(piece.lstrip("-").isdigit() for piece in pieces):
        raise ValueError(
            f"prompt {index} {text!r} is not comma-separated token ids such as 1,2,3; pass "
            "--text for text prompts"
        )
    return [int(piece) for piece in pieces]


def register(sub: Any) -> None:
    generate = sub.add_parser("generate", help="generate from prompts")
    add_engine_args(generate, default_model())
    generate.add_argument("prompts", nargs="+", help="token ids '1,2,3' (or text with --text)")
    generate.add_argument("--text", action="store_true", help="prompts are text (needs tokenizer)")
    generate.add_argument("--max-tokens", type=int, default=16)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--sampling-seed", type=int, default=None)
    generate.set_defaults(func=cmd_generate)
