"""Log-probabilities in OpenAI's two response shapes, from the engine's per-token entries.

The engine records one entry per generated token when a request sets ``SamplingParams.logprobs``
(``Request.output_logprobs``: the chosen token's log-probability, its rank, and the top-k ids and
log-probabilities). Completions use the legacy shape (``tokens``, ``token_logprobs``,
``top_logprobs`` as {token: logprob}, ``text_offset``); chat uses ``content``: one
{``token``, ``logprob``, ``bytes``, ``top_logprobs``} per token. A token's text is its decoded
string; a model without a tokenizer names tokens ``token_id:<id>`` (vLLM's
``return_tokens_as_token_ids`` spelling).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def _top(entry: Any, tokenizer: Any) -> list[tuple[str, float]]:
    return [
        (token_text(tokenizer, token_id), float(logprob))
        for token_id, logprob in zip(entry.top_ids, entry.top_logprobs)
    ]


def completion_logprobs(
    entries: Sequence[Any | None],
    tokenizer: Any,
    text_offset: int,
    token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The legacy completions shape for ``entries``, whose text starts at ``text_offset``. An
    entry may be None (an echoed prompt's first token, which nothing predicts): its token is
    ``token_ids[i]`` and its log-probability and alternatives are null."""
    if token_ids is None:
        token_ids = [entry.token_id for entry in entries if entry is not None]
    tokens, offsets = [], []
    for token_id in token_ids:
        offsets.append(text_offset)
        tokens.append(token_text(tokenizer, token_id))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else float(e.logprob) for e in entries],
        "top_logprobs": [None if e is None else dict(_top(e, tokenizer)) for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[Any], tokenizer: Any) -> dict[str, Any]:
    """The chat shape (``{"content": [...]}``) for ``entries``."""

    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        top = [item(t, lp) for t, lp in _top(entry, tokenizer)]
        content.append({**item(text, float(entry.logprob)), "top_logprobs": top})
    return {"content": content}
