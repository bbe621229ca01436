"""``LLM``: the offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``.

Prompts are lists of token ids, strings when the model has a tokenizer, or vLLM's
``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``; every prompt and parameter is checked
before any request is queued (``engine/inputs.py``), so an error leaves the engine as it was.
Results come back one per prompt, in prompt order, as ``RequestOutput`` with
``outputs[i].token_ids``, ``.text`` (with a tokenizer), ``.logprobs`` and ``.finish_reason``
(``output_processor``). ``LLM`` drives its ``EngineCore`` (``engine/core.py``) directly, in this
process.
``stream`` yields each completion's new text as it decodes; ``chat`` applies the tokenizer's
chat template to conversations first.

An ``LLM`` may be called from several threads: its calls take turns on a lock of its own (an open
``stream`` holds it until it is exhausted or closed), and engine steps of different ``LLM``
objects in one process take turns too (``engine/core.py``), so each call gets the tokens it
would get alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.engine.core import EngineCore
from pieceworks.engine.inputs import parse_prompts, sampling_params_for
from pieceworks.engine.output_processor import (
    CompletionDelta,
    CompletionOutput,
    Logprob,
    OutputProcessor,
    RequestOutput,
)
from pieceworks.engine.tokenizer import apply_chat_template, check_tokenizer_fits, load_tokenizer
from pieceworks.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionDelta", "CompletionOutput", "Logprob", "RequestOutput"]

Conversation = list[dict[str, Any]]


class LLM:
    """The offline engine: ``generate``, ``stream``, ``chat``; thread-safe, one call at a time."""

    def __init__(self, model: str, compilation_config: Any = None, **engine_args: Any) -> None:
        start = time.perf_counter()
        self.config = build_engine_config(model, compilation_config, **engine_args)
        self.config_seconds = time.perf_counter() - start  # start-up's phases: bench startup
        self.engine = EngineCore(self.config)
        start = time.perf_counter()
        self.tokenizer = load_tokenizer(model, engine_args.get("tokenizer"))
        vocab_size = self.config.model_config.hf_config["vocab_size"]
        check_tokenizer_fits(self.tokenizer, vocab_size, engine_args.get("tokenizer"))
        self.tokenizer_seconds = time.perf_counter() - start
        self.processor = OutputProcessor(self.engine, self.tokenizer)
        # Serializes the calls that queue requests or step the engine (re-entrant: ``chat``
        # calls ``generate``).
        self._lock = threading.RLock()

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in prompt order. An interrupted call (an error,
        Ctrl-C) aborts its own requests, so none is left queued for the next call to run.
        ``priority``: one int per prompt (lower first) under ``scheduling_policy="priority"``."""
        with self._lock:
            request_ids = self._add_requests(prompts, sampling_params, priority)
            try:
                while self.processor.has_unfinished_requests():
                    self.processor.step(stream=False)
            except BaseException:
                self._abort_unfinished(request_ids)
                raise
            return [self.processor.get_output(rid, forget=True) for rid in request_ids]

    def stream(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[CompletionDelta]:
        """Generate, yielding each completion's new tokens and text as steps come back.

        ``delta.request_id`` says which prompt (the ids ``generate`` would give, in prompt
        order) and ``delta.index`` which of its ``n`` completions; a completion's deltas
        concatenate to its final ``.text``. Closing the generator early aborts what is left.
        """
        with self._lock:
            request_ids = self._add_requests(prompts, sampling_params)
            try:
                while self.processor.has_unfinished_requests():
                    yield from self.processor.step()
            finally:
                self._abort_unfinished(request_ids)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of
        them, with the tokenizer's chat template (or ``chat_template``), which renders
        ``tools`` (OpenAI's function entries) as the model expects. To force a call, pass
        ``SamplingParams(structured_outputs=...)`` with the schema of the arguments."""
        conversations = _conversations(messages)
        with self._lock:
            prompts = [
                self.apply_chat_template(c, chat_template, add_generation_prompt, tools)
                for c in conversations
            ]
            return self.generate(prompts, sampling_params)

    def apply_chat_template(
        self,
        conversation: Conversation,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt token ids of a conversation (and ``tools``) under the chat template."""
        return apply_chat_template(
            self.tokenizer, conversation, chat_template, add_generation_prompt, tools
        )

    def _add_requests(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None = None,
    ) -> list[str]:
        """Queue every prompt's completions, all or none: prompts, parameters, lengths and KV
        capacity are checked for every prompt before the first is queued."""
        encode = self.tokenizer.encode if self.tokenizer is not None else None
        vocab_size = self.config.model_config.hf_config.get("vocab_size")
        parsed = parse_prompts(prompts, encode=encode, vocab_size=vocab_size)
        params_list = sampling_params_for(sampling_params, len(parsed))
        priorities = _priorities(priority, len(parsed))
        self.engine.check_requests([p.token_ids for p in parsed], params_list, priorities)
        return [
            self.processor.add_request(prompt.token_ids, params, prompt=prompt.text, priority=p)
            for prompt, params, p in zip(parsed, params_list, priorities)
        ]

    def _abort_unfinished(self, request_ids: list[str]) -> None:
        """Abort the prompts of ``request_ids`` still running and forget the finished ones."""
        for request_id in request_ids:
            if self.processor.get_output(request_id).finished:
                self.processor.get_output(request_id, forget=True)
            elif not self.engine.is_shut_down:
                self.processor.abort_request(request_id)

    def shutdown(self) -> None:
        """Free the captured graphs, stop tensor-parallel workers and free the process group
        (with several ranks also done at exit); no step may run afterwards."""
        with self._lock:
            self.engine.shutdown()


def _priorities(priority: Sequence[int] | None, num_prompts: int) -> list[int]:
    """One priority per prompt (0 each when not given); a clear error for a wrong length."""
    if priority is None:
        return [0] * num_prompts
    priorities = list(priority)
    if len(priorities) != num_prompts:
        raise ValueError(
            f"priority has {len(priorities)} entries for {num_prompts} prompts; pass one int "
            "per prompt"
        )
    return priorities


def _conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation or a list of them, as a list; a clear error for anything else."""
    items: list[Any] = list(messages)
    if items and all(isinstance(m, dict) for m in items):
        return [items]
    if items and all(
        isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in items
    ):
        return [list(c) for c in items]
    raise ValueError(
        "messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} "
        "dicts) or a list of such conversations"
    )
