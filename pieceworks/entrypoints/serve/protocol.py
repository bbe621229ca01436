"""The request bodies of the OpenAI API that the server accepts, as pydantic models.

Field names and defaults follow OpenAI's (and vLLM's extensions: ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids``). Fields the API defines but this server does not use
are accepted and ignored; unknown fields are ignored too, as OpenAI's clients send extras; a
known field with a value of the wrong type or out of range fails validation, which the server
answers with 400 and pydantic's reason. Responses are built as plain dicts by the handlers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields completions and chat share: sampling, stopping, streaming, how many choices."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids or lists of ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) wins over ``max_tokens``."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )
