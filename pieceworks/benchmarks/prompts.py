"""The prompts of ``bench latency`` (``--prompt-kind``): random, repeating, or a text to copy.

- ``random``: uniform random token ids, ``input_len`` per prompt (seeded; the default).
- ``repeat``: a random passage of about ``input_len / 4`` tokens repeated to fill ``input_len``.
  The text repeats already, so an n-gram proposer finds matches, and a model that continues the
  pattern has its proposals accepted: the case speculative decoding is built for.
- ``copy``: for a model with a tokenizer, a fixed English passage (``PASSAGE``, public domain)
  followed by an instruction to repeat it, in the model's chat template where it has one: what a
  trained model answers by copying. The passage is cut (or repeated) so the prompt has exactly
  ``input_len`` tokens; every prompt of the batch is the same.

The same prompts reach the pieceworks engines and the peers (``latency._prompts``). Not here:
timing, the engine, the CLI flag (``entrypoints/bench.py``).
"""

from __future__ import annotations

import random
from typing import Any

PROMPT_KINDS = ("random", "repeat", "copy")

# Lewis Carroll, "Alice's Adventures in Wonderland" (1865), the opening of chapter I.
PASSAGE = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading, but it "
    'had no pictures or conversations in it, "and what is the use of a book," thought Alice '
    '"without pictures or conversations?"\n\n'
    "So she was considering in her own mind (as well as she could, for the hot day made her "
    "feel very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth "
    "the trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink "
    "eyes ran close by her.\n\n"
    "There was nothing so very remarkable in that; nor did Alice think it so very much out of "
    'the way to hear the Rabbit say to itself, "Oh dear! Oh dear! I shall be late!" (when she '
    "thought it over afterwards, it occurred to her that she ought to have wondered at this, "
    "but at the time it all seemed quite natural); but when the Rabbit actually took a watch "
    "out of its waistcoat-pocket, and looked at it, and then hurried on, Alice started to her "
    "feet, for it flashed across her mind that she had never before seen a rabbit with either a "
    "waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran across "
    "the field after it, and fortunately was just in time to see it pop down a large "
    "rabbit-hole under the hedge.\n\n"
    "In another moment down went Alice after it, never once considering how in the world she "
    "was to get out again.\n\n"
    "The rabbit-hole went straight on like a tunnel for some way, and then dipped suddenly "
    "down, so suddenly that Alice had not a moment to think about stopping herself before she "
    "found herself falling down a very deep well."
)
INSTRUCTION = "Repeat the text above word for word."
_MARKER = "<<passage>>"


def parse_prompt_kinds(text: str) -> list[str]:
    """``--prompt-kind``: one kind or a comma list, in order, each once."""
    kinds = list(dict.fromkeys(kind.strip() for kind in text.split(",") if kind.strip()))
    unknown = [kind for kind in kinds if kind not in PROMPT_KINDS]
    if unknown or not kinds:
        raise ValueError(
            f"--prompt-kind {text!r}: unknown kind(s) {unknown}; choose from "
            f"{', '.join(PROMPT_KINDS)} (one or a comma list)"
        )
    return kinds


def check_prompt_kinds(kinds: list[str], tokenizer: Any) -> None:
    """``copy`` needs the model's tokenizer: refused, naming the option, without one."""
    if "copy" in kinds and tokenizer is None:
        raise ValueError(
            "--prompt-kind copy needs a model with a tokenizer (an HF directory with tokenizer "
            "files or a GGUF file); this model has none: use --prompt-kind random "
            "or repeat"
        )


def latency_prompts(
    kind: str, batch_size: int, input_len: int, vocab_size: int, tokenizer: Any = None
) -> list[list[int]]:
    """``batch_size`` prompts of exactly ``input_len`` token ids of ``kind``."""
    rng = random.Random(0)
    if kind == "random":
        return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(batch_size)]
    if kind == "repeat":
        period = max(1, input_len // 4)
        prompts = []
        for _ in range(batch_size):
            passage = [rng.randrange(vocab_size) for _ in range(period)]
            prompts.append((passage * (input_len // period + 1))[:input_len])
        return prompts
    if kind == "copy":
        check_prompt_kinds([kind], tokenizer)
        return [copy_prompt(tokenizer, input_len)] * batch_size
    raise ValueError(f"unknown prompt kind {kind!r}; choose from {', '.join(PROMPT_KINDS)}")


def copy_prompt(tokenizer: Any, input_len: int) -> list[int]:
    """``PASSAGE`` then ``INSTRUCTION`` (in the chat template where the tokenizer has one), the
    passage's tokens cut or repeated so that the prompt has ``input_len`` tokens."""
    prefix, suffix = _template_parts(tokenizer)
    num_passage_tokens = input_len - len(prefix) - len(suffix)
    if num_passage_tokens < 1:
        raise ValueError(
            f"--prompt-kind copy: --input-len {input_len} leaves no room for the passage (the "
            f"template and the instruction take {len(prefix) + len(suffix)} tokens); use "
            f"--input-len {len(prefix) + len(suffix) + 64} or more"
        )
    passage = list(tokenizer.encode(PASSAGE, add_special_tokens=False))
    passage = (passage * (num_passage_tokens // len(passage) + 1))[:num_passage_tokens]
    return prefix + passage + suffix


def _template_parts(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The token ids before and after the passage: the chat template's (and the instruction),
    or the tokenizer's special tokens and the instruction where it has no template."""
    content = f"{_MARKER}\n\n{INSTRUCTION}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        before, after = text.split(_MARKER)
        encode = lambda part: list(tokenizer.encode(part, add_special_tokens=False))  # noqa: E731
        return encode(before), encode(after)
    before = list(tokenizer.encode("", add_special_tokens=True))  # BOS where it adds one
    return before, list(tokenizer.encode(f"\n\n{INSTRUCTION}\n\n", add_special_tokens=False))
