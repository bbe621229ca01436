"""``pieceworks generate``: answer prompts given on the command line.

Prompts are text when the model has a tokenizer, and a chat model (one whose tokenizer has a chat
template, like SmolLM2-Instruct) gets each prompt as one user message under that template, as
``ollama run`` or a chat UI would send it: an instruction-tuned model asked a bare question
without its template often answers nothing useful. ``--no-chat`` sends the text as it is (a raw
completion); ``--chat`` insists on the template. Comma-separated token ids (``1,2,3``) are read
as ids with ``--token-ids``, or on their own for a model without a tokenizer (presets).
"""

from __future__ import annotations

import argparse
from typing import Any

from pieceworks.entrypoints.engine_args import (
    add_engine_args,
    add_sampling_args,
    compilation_fields,
    engine_args,
    sampling_params,
    text_default_model,
)


def parse_token_ids(prompt: str, index: int) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; a clear error naming the prompt for anything else."""
    pieces = [piece.strip() for piece in prompt.split(",")]
    if not all(piece.lstrip("-").isdigit() for piece in pieces):
        raise ValueError(
            f"prompt {index} {prompt!r} is not comma-separated token ids such as 1,2,3 (the "
            "model has no tokenizer, or --token-ids was given)"
        )
    return [int(piece) for piece in pieces]


def check_text(prompt: str, index: int) -> str:
    """A command-line text prompt; it must not be empty."""
    if not prompt.strip():
        raise ValueError(f"prompt {index} is empty; pass some text")
    return prompt


def early_token_ids(args: argparse.Namespace) -> list[list[int]] | None:
    """The prompts as token ids, parsed before the model is built where that is already known
    (``--token-ids``, or a preset, which has no tokenizer); None when they may be text. Empty
    prompts are refused either way."""
    from pieceworks.models.loading.presets import is_preset

    texts = [check_text(prompt, index) for index, prompt in enumerate(args.prompts)]
    if args.token_ids and args.chat:
        raise ValueError(
            "--chat and --token-ids do not go together: --chat applies the chat template to "
            "text prompts, --token-ids sends ids as they are; drop one of them"
        )
    if not (args.token_ids or is_preset(args.model)):
        return None
    if args.chat:
        raise ValueError("--chat needs a model with a tokenizer and chat template")
    return [parse_token_ids(text, index) for index, text in enumerate(texts)]


def build_prompts(llm: Any, args: argparse.Namespace) -> list[Any]:
    """The prompts as ``LLM.generate`` takes them: token ids, text, or chat-templated ids."""
    if llm.tokenizer is None:
        if args.chat:
            raise ValueError("--chat needs a model with a tokenizer and chat template")
        return [parse_token_ids(prompt, index) for index, prompt in enumerate(args.prompts)]
    has_template = bool(getattr(llm.tokenizer, "chat_template", None))
    use_chat = has_template if args.chat is None else args.chat
    if not use_chat:
        return list(args.prompts)
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompts]


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate for every prompt and print each completion (its text, or its token ids)."""
    from pieceworks.engine.llm import LLM

    params = sampling_params(args)  # checked before the model is built
    token_ids = early_token_ids(args)
    llm = LLM(args.model, compilation_config=compilation_fields(args) or None, **engine_args(args))
    prompts = token_ids if token_ids is not None else build_prompts(llm, args)
    for output in llm.generate(prompts, params):
        for completion in output.outputs:
            shown = completion.text if completion.text is not None else completion.token_ids
            label = (
                output.request_id
                if len(output.outputs) == 1
                else f"{output.request_id}.{completion.index}"
            )
            print(f"[{label}] ({completion.finish_reason}) {shown}")
            if completion.logprobs is not None:
                print(format_logprobs(completion))
    return 0


def format_logprobs(completion: Any) -> str:
    """One line per generated token: the token, its log-probability and rank, then every entry
    of its position (the top-k and the token itself)."""
    lines = []
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        chosen = position[token_id]
        entries = ", ".join(
            f"{_token_name(entry, tid)}:{entry.logprob:.3f}" for tid, entry in position.items()
        )
        lines.append(
            f"  {_token_name(chosen, token_id)} logprob {chosen.logprob:.4f} "
            f"rank {chosen.rank}  [{entries}]"
        )
    lines.append(f"  cumulative logprob {completion.cumulative_logprob:.4f}")
    return "\n".join(lines)


def _token_name(entry: Any, token_id: int) -> str:
    return repr(entry.decoded_token) if entry.decoded_token is not None else str(token_id)


def register(sub: Any) -> None:
    generate = sub.add_parser("generate", help="generate from prompts")
    add_engine_args(generate, text_default_model())
    generate.add_argument("prompts", nargs="+", help="text, or token ids '1,2,3'")
    generate.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the model's chat template to each prompt (default: when it has one)",
    )
    generate.add_argument(
        "--token-ids", action="store_true", help="prompts are comma-separated token ids"
    )
    add_sampling_args(generate)
    generate.set_defaults(func=cmd_generate)
