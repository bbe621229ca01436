"""``SpeculativeConfig``: speculative decoding, vLLM's ``speculative_config`` dict.

Sits with the configs, below everything. ``SpeculativeConfig.from_fields`` reads the dict (or its
JSON text, as ``--speculative-config`` passes it) and refuses unknown keys and methods by name;
``EngineConfig`` checks the combinations with the rest of the engine (``check_engine``). The
proposers are the worker's (``pieceworks/worker/spec_decode/``); how verification runs is in
``docs/engine.md``, "Speculative decoding".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Methods a user may name: prompt lookup, and a smaller model of the same vocabulary.
SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's default n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclasses.dataclass
class SpeculativeConfig:
    """How many tokens a proposer guesses per step and how (``method``).

    ``ngram`` (prompt lookup): the last ``n`` tokens of a request, ``n`` from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``, are looked up in its prompt and output so
    far, and the ``num_speculative_tokens`` tokens that followed the latest earlier match are
    proposed. One bound given alone sets the other. ``draft_model``: ``model`` (a preset, an HF
    directory or a GGUF file with the target's vocabulary) proposes its greedy tokens.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # the draft model ("draft_model")

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is unknown; use one of "
                f"{list(SPECULATIVE_METHODS)}"
            )
        if self.method == "draft_model":
            self._check_draft_model()
        elif self.model is not None:
            raise ValueError(
                f"speculative_config 'model' is for the 'draft_model' method, not {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config num_speculative_tokens={k!r} must be a positive integer"
            )
        if self.method == "ngram":
            self._resolve_lookup_bounds()

    def _resolve_lookup_bounds(self) -> None:
        """One bound sets the other; neither: vLLM's default."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low, high = low if low is not None else high, high if high is not None else low
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r} must be a positive integer")
        assert low is not None and high is not None
        if low > high:
            raise ValueError(
                f"speculative_config prompt_lookup_min={low} is above prompt_lookup_max={high}"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    def _check_draft_model(self) -> None:
        if not self.model:
            raise ValueError(
                "speculative_config method 'draft_model' needs 'model': the draft model (a "
                "preset, an HF directory or a GGUF file with the target's vocabulary)"
            )
        set_bounds = [
            name
            for name in ("prompt_lookup_min", "prompt_lookup_max")
            if getattr(self, name) is not None
        ]
        if set_bounds:
            raise ValueError(
                f"speculative_config {set_bounds} apply to the 'ngram' method, not 'draft_model'"
            )

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a decode may need beyond its one known token: one per proposal."""
        return self.num_speculative_tokens

    def verify_graph_sizes(self, config: Any) -> list[int]:
        """Token counts of the FULL graphs captured for uniform verify batches: ``S * (1 + k)``
        for each capture size ``S`` of sequences that a decode batch can have and whose tokens
        fit one step."""
        query_len = 1 + self.num_speculative_tokens
        scheduler = config.scheduler_config
        return [
            size * query_len
            for size in config.compilation_config.cudagraph_capture_sizes or []
            if size <= scheduler.max_num_seqs
            and size * query_len <= scheduler.max_num_batched_tokens
        ]

    @classmethod
    def from_fields(cls, fields: SpeculativeConfig | dict[str, Any] | str | None) -> Any:
        """A config from vLLM's dict (or its JSON text); None stays None. Unknown keys are
        refused naming them."""
        if fields is None or isinstance(fields, SpeculativeConfig):
            return fields
        if isinstance(fields, str):
            try:
                fields = json.loads(fields)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON ({error})") from None
        if not isinstance(fields, dict):
            raise ValueError(
                f"speculative_config must be a dict such as "
                f'{{"method": "ngram", "num_speculative_tokens": 3}}, not {type(fields).__name__}'
            )
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown}; known: {sorted(known)}"
            )
        if "num_speculative_tokens" not in fields:
            raise ValueError("speculative_config needs num_speculative_tokens (tokens per step)")
        return cls(**fields)

    def check_engine(self, config: Any) -> None:
        """Refuse the engine settings speculation does not implement, naming them."""
        scheduler = config.scheduler_config
        if scheduler.num_scheduler_steps > 1:
            raise ValueError(
                f"speculative decoding with num_scheduler_steps={scheduler.num_scheduler_steps} "
                "is not implemented; use num_scheduler_steps=1 or no speculative_config"
            )
        if config.parallel_config.tensor_parallel_size > 1:
            raise ValueError(
                "speculative decoding with tensor_parallel_size > 1 is not implemented; use one "
                "rank or no speculative_config"
            )
