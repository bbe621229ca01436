"""Tokenizers for every model source: HF dirs, GGUF files, ``smollm2-135m``; none for presets.

``load_tokenizer(model, tokenizer=None)`` returns an HF ``PreTrainedTokenizerFast`` (``encode``,
``decode(..., skip_special_tokens=...)``, ``eos_token_id``, ``all_special_ids``,
``apply_chat_template`` with ``.chat_template`` set when the source has one), or None when the
source has no tokenizer (presets, whose weights are random, and HF directories without tokenizer
files): such models take token-id prompts only.

An HF directory's tokenizer files go through ``AutoTokenizer``. A GGUF file has no
``tokenizer.json``: llama.cpp stores the vocabulary, the merges, the token types, the special ids
and the chat template as ``tokenizer.*`` metadata. A byte-level BPE vocabulary
(``tokenizer.ggml.model = gpt2``, SmolLM2's and most BPE models') is rebuilt here with the
``tokenizers`` library, splitting text the way the vocabulary's ``tokenizer.ggml.pre`` says
(llama.cpp's ``llama-vocab.cpp`` lists the splits); any other vocabulary goes through
transformers' own GGUF converter (``from_pretrained(..., gguf_file=...)``, slower): for an
architecture whose tokenizer class is known (Gemma 3: ``GemmaTokenizer``, SentencePiece BPE with
its merges rebuilt from the vocabulary order, BOS added) that class directly, which skips
transformers' parse of the model config; else ``AutoTokenizer``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from pieceworks.engine.inputs import check_unicode
from pieceworks.models.loading.gguf_loader import (
    gguf_architecture_name,
    gguf_tokenizer_metadata,
)
from pieceworks.models.loading.sources import ModelSource, resolve_model_source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# llama.cpp token types (tokenizer.ggml.token_type): which vocabulary entries are added tokens.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# tokenizer.ggml.model values with a tokenizer here: SentencePiece BPE (llama, through
# transformers' converter) and byte-level BPE (gpt2).
GGUF_TOKENIZER_MODELS = ("llama", "gpt2")
# general.architecture -> the transformers tokenizer class its GGUF vocabulary converts to.
GGUF_TOKENIZER_CLASSES = {"gemma3": "GemmaTokenizer"}

# tokenizer.ggml.pre values whose text split is "each digit alone, then GPT-2's regex"
# (llama.cpp: LLAMA_VOCAB_PRE_TYPE_STARCODER, _REFACT, _COMMAND_R, _SMOLLM, _CODESHELL, ...).
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell"})
_GPT2 = frozenset({"gpt2", "default", "gpt-2"})
# Llama 3's split (llama.cpp: LLAMA_VOCAB_PRE_TYPE_LLAMA3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"})


def check_tokenizer_fits(tokenizer: Any, vocab_size: int | None, source: str | None) -> None:
    """A tokenizer named apart from the model (``--tokenizer``) must not produce ids past the
    model's vocabulary (when it is known); a model's own may be smaller than its (padded)
    embedding."""
    if tokenizer is None or source is None or vocab_size is None:
        return
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer {source!r} has {len(tokenizer)} tokens, more than the model's vocabulary "
            f"of {vocab_size}: its ids would index past the embedding; pass the model's own "
            "tokenizer or one of the same vocabulary"
        )


def load_tokenizer(model: str, tokenizer: str | None = None) -> Any:
    """The tokenizer of ``tokenizer`` if given, else of ``model``; None if the source has none.

    Both name a model source (``resolve_model_source``): a preset (no tokenizer), an HF directory,
    a ``*.gguf`` file or ``smollm2-135m``.
    """
    source = resolve_model_source(tokenizer or model)
    if source.kind == "preset":
        return None
    if source.kind == "gguf":
        return _cached_gguf_tokenizer(str(_checked_path(source).resolve()))
    directory = _checked_path(source)
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as error:  # a file that does not parse: tokenizers' and json's own errors
        raise ValueError(
            f"{directory}: its tokenizer files ({', '.join(_present(directory))}) do not load "
            f"({type(error).__name__}: {' '.join(str(error).split())[:200]}); replace them with "
            "the model's own, or remove them to pass token-id prompts"
        ) from None


def _present(directory: Path) -> list[str]:
    return [name for name in TOKENIZER_FILES if (directory / name).exists()]


def _checked_path(source: ModelSource) -> Path:
    if source.path is None:
        raise ValueError(f"model source {source.name!r} has no file or directory")
    return source.path


def apply_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt token ids of a conversation under ``tokenizer``'s chat template (or
    ``chat_template``); ``LLM.chat`` and the server's chat endpoint both render through here.
    ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` entries) reach the template
    as its ``tools`` variable (transformers' convention), which renders them as the model
    expects."""
    if tokenizer is None:
        raise ValueError(
            "chat needs a tokenizer with a chat template; this model has no tokenizer "
            "(presets have random weights): use a model directory or GGUF file with one"
        )
    if chat_template is not None and not chat_template.strip():
        raise ValueError(
            "chat_template is empty; pass the Jinja text of a template, or leave it out to use "
            "the tokenizer's own"
        )
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; pass chat_template=<jinja text> "
            "or use generate() with plain prompts"
        )
    conversation = [_text_message(message, index) for index, message in enumerate(conversation)]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools or None,
        )
    except (
        Exception
    ) as error:  # Jinja's syntax and runtime errors, raise_exception(...) of a template
        which = (
            "the chat_template given" if chat_template is not None else "the model's chat template"
        )
        raise ValueError(
            f"{which} does not render this conversation ({type(error).__name__}: {error}); "
            "fix the template, pass another with chat_template=..., or change the messages"
        ) from error
    # The template writes the special tokens itself: encoding must not add a second BOS.
    return list(tokenizer.encode(text, add_special_tokens=False))


def _text_message(message: Any, index: int) -> dict[str, Any]:
    """``message`` with its content as one string: OpenAI's list of content parts is accepted
    when every part is text (joined by newlines, as vLLM does); anything else is refused."""
    where = f"message {index}"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', not {message!r:.60}")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"{where}: content part of type {kind!r} is not supported; this engine takes "
                    "text only (parts of type 'text' with a 'text' string)"
                )
            texts.append(part["text"])
        message = {**message, "content": "\n".join(texts)}
    if isinstance(message.get("content"), str):
        check_unicode(message["content"], where)
    return message


@functools.lru_cache(maxsize=4)
def _cached_gguf_tokenizer(path: str) -> Any:
    return gguf_tokenizer(path)


def gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer a GGUF file's metadata describes (see the module docstring)."""
    metadata = gguf_tokenizer_metadata(path)
    if "ggml.tokens" not in metadata:
        raise ValueError(
            f"{path}: the GGUF file has no tokenizer (no tokenizer.ggml.tokens metadata); "
            "pass token-id prompts, or a tokenizer with tokenizer=<HF dir or .gguf file>"
        )
    if metadata.get("ggml.model") not in GGUF_TOKENIZER_MODELS:
        raise ValueError(
            f"{path}: tokenizer.ggml.model={metadata.get('ggml.model')!r} is not supported "
            f"(supported: {', '.join(GGUF_TOKENIZER_MODELS)}); pass token-id prompts, or a "
            "tokenizer with tokenizer=<HF dir>"
        )
    if metadata.get("ggml.model") == "gpt2" and _byte_level_pre_tokenizer(metadata) is not None:
        return _byte_level_bpe_tokenizer(metadata)
    import transformers

    path = Path(path)
    architecture = gguf_architecture_name(path) or ""
    tokenizer_class = getattr(
        transformers, GGUF_TOKENIZER_CLASSES.get(architecture, "AutoTokenizer")
    )
    return tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(metadata: dict[str, Any]) -> Any:
    """The ``tokenizers`` pre-tokenizer for ``tokenizer.ggml.pre``; None if unknown here."""
    from tokenizers import Regex, pre_tokenizers

    pre = metadata.get("ggml.pre", "default")
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _LLAMA3:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return None


def _byte_level_bpe_tokenizer(metadata: dict[str, Any]) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` from GGUF vocabulary and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = list(metadata["ggml.tokens"])
    token_types: list[int] = list(metadata.get("ggml.token_type") or [])
    alphabet = set(bytes_to_unicode().values())
    spelling = bytes_to_unicode()
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("ggml.merges") or []]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(metadata)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) match whole and are special (skipped when decoding
    # with skip_special_tokens); user-defined ones match whole but stay text.
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind == TOKEN_TYPE_CONTROL and set(token) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind == TOKEN_TYPE_USER_DEFINED
        ]
    )
    special = _special_tokens(metadata, tokens)
    bos_token = special.get("bos_token")
    if metadata.get("ggml.add_bos_token") and bos_token is not None:
        bos_id = tokens.index(bos_token)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A",
            pair=f"{bos_token} $A {bos_token} $B",
            special_tokens=[(bos_token, bos_id)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=metadata.get("chat_template"), **special
    )


def _special_tokens(metadata: dict[str, Any], tokens: list[str]) -> dict[str, str]:
    """``bos_token``/``eos_token``/``unk_token``/``pad_token`` from the ``*_token_id`` keys."""
    keys = {
        "bos_token": "ggml.bos_token_id",
        "eos_token": "ggml.eos_token_id",
        "unk_token": "ggml.unknown_token_id",
        "pad_token": "ggml.padding_token_id",
    }
    special: dict[str, str] = {}
    for name, key in keys.items():
        token_id = metadata.get(key)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special[name] = tokens[int(token_id)]
    return special
