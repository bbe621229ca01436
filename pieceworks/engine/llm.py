"""``LLM``: the offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``.

Prompts are lists of token ids, or strings when the model directory has a tokenizer, or vLLM's
``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}`` (``engine/inputs.py``). Results come
back one per prompt, in prompt order, as ``RequestOutput`` with ``outputs[0].token_ids``,
``.text`` (with a tokenizer) and ``.finish_reason``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.engine.inputs import parse_prompts, sampling_params_for
from pieceworks.engine.llm_engine import LLMEngine
from pieceworks.engine.sampling_params import SamplingParams
from pieceworks.engine.tokenizer import load_tokenizer


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    def __init__(self, model: str, compilation_config: Any = None, **engine_args: Any) -> None:
        self.config = build_engine_config(model, compilation_config, **engine_args)
        self.engine = LLMEngine(self.config)
        self.tokenizer = load_tokenizer(model, engine_args.get("tokenizer"))

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in prompt order.

        Prompts take vLLM's forms (``engine/inputs.py``); every prompt and parameter is checked
        before any request is queued, so an error leaves the engine as it was.
        """
        parsed = parse_prompts(prompts, encode=self._text_encoder(), vocab_size=self._vocab_size())
        params_list = sampling_params_for(sampling_params, len(parsed))
        requests = self.engine.add_requests([p.token_ids for p in parsed], params_list)
        self._run_to_completion(requests)
        return [self._output(request, prompt.text) for request, prompt in zip(requests, parsed)]

    def _run_to_completion(self, requests: list[Any]) -> None:
        """Step until the engine is idle; an interrupted call (an error, Ctrl-C) aborts its
        requests, so none of them is left queued for the next call to run."""
        try:
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # a shut-down engine has nothing to abort
                for request in requests:
                    self.engine.abort_request(request.request_id)
            raise

    def _text_encoder(self) -> Callable[[str], list[int]] | None:
        return self.tokenizer.encode if self.tokenizer is not None else None

    def _vocab_size(self) -> int | None:
        return self.config.model_config.hf_config.get("vocab_size")

    def shutdown(self) -> None:
        """Free the captured graphs, stop tensor-parallel workers and free the process group
        (with several ranks also done at exit); no step may run afterwards."""
        self.engine.shutdown()

    def _output(self, request: Any, prompt: str | None) -> RequestOutput:
        text = self.tokenizer.decode(request.output_token_ids) if self.tokenizer else None
        completion = CompletionOutput(
            0, list(request.output_token_ids), text, request.finish_reason
        )
        return RequestOutput(request.request_id, prompt, request.prompt_token_ids, [completion])
