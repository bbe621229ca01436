"""The request bodies of the OpenAI API that the server accepts, as pydantic models.

Field names and defaults follow OpenAI's (and vLLM's extensions: ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids``, the structured-output fields ``structured_outputs`` and
``guided_*``). Every field OpenAI or vLLM define is honoured or refused: one this server does not
implement (``suffix``, ``best_of``, ``functions``, vLLM's ``min_p``, ...; ``UNSUPPORTED_FIELDS``)
fails validation when sent with a value other than its neutral one (null, or the value that
changes nothing), and the server answers 400 naming it (and, where one exists, what to send
instead: ``UNSUPPORTED_HINTS``). Chat content parts other than text (``image_url``,
``input_audio``, ``file``, ...) are refused the same way. Names neither API defines are ignored,
as OpenAI's clients may
send extras. A known field with a value of the wrong type or out of range fails validation too,
which the server answers with 400 and pydantic's reason. Responses are built as plain dicts by
the handlers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

# Fields of OpenAI's or vLLM's request bodies this server does not implement, each with the
# values that ask for nothing (accepted); any other value is refused with 400 naming the field.
_SHARED_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
}
_COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
# What the server offers instead of an unsupported field, where it offers something.
UNSUPPORTED_HINTS = {
    "suffix": "this server completes a prompt only at its end (no insertion); leave suffix out",
    "best_of": (
        "this server returns every one of the n choices it generates and ranks none; "
        "leave best_of out (or 1) and send n"
    ),
    "prompt_logprobs": "for the prompt's log-probabilities send echo=true with logprobs",
    "tools": "tool calling is a chat feature: send the tools to /v1/chat/completions",
    "tool_choice": "tool calling is a chat feature: send the tools to /v1/chat/completions",
}
_CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "continue_final_message": (None, False),
}
UNSUPPORTED_FIELDS = {
    "completions": {**_SHARED_UNSUPPORTED, **_COMPLETION_UNSUPPORTED},
    "chat": {**_SHARED_UNSUPPORTED, **_CHAT_UNSUPPORTED},
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """``value`` is one of ``neutral`` (``True`` is not ``1``, nor ``0`` ``False``)."""
    return any(value is ok or (type(value) is type(ok) and value == ok) for ok in neutral)


def _refuse_unless_neutral(neutral: dict[str, tuple[Any, ...]], name: str, value: Any) -> Any:
    if _is_neutral(value, neutral[name]):
        return value
    hint = UNSUPPORTED_HINTS.get(name, "leave it out")
    raise PydanticCustomError(
        "unsupported_field",
        "this server does not implement {name}; {hint}",
        {"name": name, "hint": hint},
    )


def _logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` ({token id as a string: bias in [-100, 100]}) as ids -> floats."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PydanticCustomError(
            "logit_bias", "must be an object mapping token ids (as strings) to biases"
        )
    bias: dict[int, float] = {}
    for key, number in value.items():
        token_id = int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if token_id is None:
            raise PydanticCustomError(
                "logit_bias",
                'key "{key}" is not a token id: keys are token ids as strings, such as "1234"',
                {"key": key},
            )
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise PydanticCustomError(
                "logit_bias", "the bias of token {key} must be a number", {"key": key}
            )
        if not -100 <= number <= 100:
            raise PydanticCustomError(
                "logit_bias",
                "the bias of token {key} is {number}; biases are in [-100, 100]",
                {"key": key, "number": number},
            )
        bias[token_id] = float(number)
    return bias or None


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
    user: str | None = None  # an end-user id for the caller's own records; changes nothing
    # vLLM's: lower is scheduled first under --scheduling-policy priority (else it must be 0)
    priority: int = Field(default=0, strict=True)
    logit_bias: dict[int, float] | None = None  # parsed from OpenAI's {"id": bias} by _logit_bias
    # Not implemented: refused unless neutral (``_SHARED_UNSUPPORTED``).
    min_p: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    # Output constraints (``structured.py``): vLLM's newer object and its older fields.
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator(*_SHARED_UNSUPPORTED)
    @classmethod
    def _shared_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(_SHARED_UNSUPPORTED, info.field_name or "", value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _parse_logit_bias(cls, value: Any) -> dict[int, float] | None:
        return _logit_bias(value)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


_INT_ONLY = {int}


def _token_ids_first(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A list of ints as it is; anything else through the union's own validation. pydantic
    checks each member of the union against every element (about 0.25 ms for 1,000 token ids,
    paid per request); one pass over the elements' types settles the usual case."""
    if type(value) is list and value and {*map(type, value)} == _INT_ONLY:
        return value
    return handler(value)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids or lists of ids."""

    prompt: Annotated[
        str | list[str] | list[int] | list[list[int]], WrapValidator(_token_ids_first)
    ]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt (and, with logprobs, its log-probabilities) before the text
    response_format: Any = None  # as chat's (``structured.py``), as vLLM's completions take it
    # Not implemented: refused unless neutral (``_COMPLETION_UNSUPPORTED``).
    suffix: Any = None
    best_of: Any = None
    tools: Any = None
    tool_choice: Any = None

    @field_validator(*_COMPLETION_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(_COMPLETION_UNSUPPORTED, info.field_name or "", value)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


def _text_parts_only(content: Any) -> Any:
    """Refuse a content part that is not text (``image_url``, ``input_audio``, ``file``, ...)
    with its type named, before the union of ``str`` and parts reports both its branches."""
    if not isinstance(content, list):
        return content
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise PydanticCustomError(
                "unsupported_content",
                "content part {index} has type '{kind}'; this server takes text only: send the "
                "content as a string or as parts of type 'text'",
                {"index": index, "kind": kind},
            )
    return content


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to that call
    name: str | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it (tool fields only when present)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message

    _content = field_validator("content", mode="before")(_text_parts_only)

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
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # Output format and tools (``structured.py``, ``tool_calls.py``).
    response_format: Any = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Not implemented: refused unless neutral (``_CHAT_UNSUPPORTED``).
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    continue_final_message: Any = None

    @field_validator(*_CHAT_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(_CHAT_UNSUPPORTED, info.field_name or "", value)

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) wins over ``max_tokens``."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` of a text prompt (vLLM's ``TokenizeCompletionRequest``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` of a conversation, rendered by the chat template (vLLM's
    ``TokenizeChatRequest``: the template writes the special tokens, so none are added)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    # Not implemented: refused unless neutral.
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    tools: Any = None

    @field_validator("continue_final_message", "chat_template", "chat_template_kwargs", "tools")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(_CHAT_UNSUPPORTED, info.field_name or "", value)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
