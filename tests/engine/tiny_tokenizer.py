"""A byte-level tokenizer of 256 tokens (llama-tiny's vocabulary) saved as an HF directory.

Built from the GGUF-style metadata of ``tests/engine/test_llm_chat.py`` (three special tokens,
then every byte but 0, 1 and 2; EOS is ``<|im_end|>``, id 2, llama-tiny's EOS), so a random
llama-tiny can take text, a chat template and grammars. ``encode(text)`` is exact for text
without special tokens: one token per UTF-8 byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pieceworks.engine import tokenizer as tokenizer_module
from pieceworks.engine.tokenizer import gguf_tokenizer
from tests.engine.test_llm_chat import METADATA


def save_tiny_tokenizer(directory: Path) -> str:
    """Write the tokenizer into ``directory``; its path, for ``LLM(..., tokenizer=...)``."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(tokenizer_module, "gguf_tokenizer_metadata", lambda path: METADATA)
        tokenizer = gguf_tokenizer("models/tiny.gguf")
    tokenizer.save_pretrained(directory)
    return str(directory)
