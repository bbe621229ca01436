"""``LLM``: the offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``.

Prompts are lists of token ids, or strings when the model directory has a tokenizer. Results come
back one per prompt, in prompt order, as ``RequestOutput`` with ``outputs[0].token_ids``,
``.text`` (with a tokenizer) and ``.finish_reason``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pieceworks.engine.arg_utils import build_engine_config
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

    def _encode(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "string prompts need a tokenizer; this model has none (presets "
                    "have random weights): pass lists of token ids instead"
                )
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        encoded = [self._encode(prompt) for prompt in prompts]
        requests = [self.engine.add_request(ids, p) for (_, ids), p in zip(encoded, params_list)]
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return [self._output(request, text) for request, (text, _) in zip(requests, encoded)]

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
