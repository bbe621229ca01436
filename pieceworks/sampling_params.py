"""``SamplingParams``: how one request's tokens are chosen and when its generation stops.

Owns validation of the user-facing sampling knobs (vLLM's names and meanings). It does not sample:
``pieceworks.worker.sampler`` turns a batch of these into per-row tensors once per step, the
scheduler reads ``max_tokens``, ``stop_token_ids`` and ``ignore_eos`` to finish requests, and the
``OutputProcessor`` reads ``n``, ``stop``, ``logprobs``, ``prompt_logprobs`` and
``skip_special_tokens``; the sampler reads ``logit_bias``. ``structured_outputs`` (a
``StructuredOutputsParams``) constrains the tokens to a JSON schema, a regex, a choice of strings
or an EBNF grammar (``pieceworks.worker.structured_output`` compiles and enforces it).
"""

from __future__ import annotations

import dataclasses
import json as json_text
import math
import numbers
from collections.abc import Sequence

# Temperatures below this are treated as greedy: dividing logits by them overflows (vLLM's rule).
SAMPLING_EPS = 1e-5
# The seeds a ``torch.Generator`` takes (``manual_seed``: a signed or unsigned 64-bit integer).
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


# The kinds of constraint ``StructuredOutputsParams`` carries, one per request (vLLM's names).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (the output is one
    of these strings), ``grammar`` (EBNF, xgrammar's dialect of GBNF) or ``json_object`` (any
    JSON object). ``disable_any_whitespace`` makes JSON compact (xgrammar's fixed separators)
    instead of allowing whitespace between tokens. A dict schema is kept as its JSON text, so
    the params stay hashable and equal schemas share one compiled grammar."""

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json_text.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [
            kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"structured_outputs choice={self.choice!r} must be non-empty strings")
        for kind in ("json", "regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs {kind}={value!r} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, spec, disable_any_whitespace): what a compiled grammar is cached by."""
        spec = getattr(self, self.kind)
        text = "\x00".join(spec) if self.kind == "choice" else str(spec)
        return self.kind, text, self.disable_any_whitespace


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters for one request; one instance may be shared by many.

    ``temperature`` 0 is greedy (argmax). ``top_k`` 0 or -1 disables top-k; ``top_p`` 1.0 disables
    top-p. ``seed`` gives the request its own random generator, so the same seed yields the same
    tokens whatever batch the request runs in. Generation stops at the model's EOS token (unless
    ``ignore_eos``), at any of ``stop_token_ids`` (both kept in the output), or after
    ``max_tokens`` generated tokens, or when the text contains one of the ``stop`` strings (the
    string and what follows it are cut from ``.text``; the finish reason is "stop").

    ``n`` completions are generated per prompt; with a ``seed``, completion ``i`` uses seed
    ``seed + i``, so they differ from each other and are the same on every run. ``logprobs=k``
    returns, per generated token, the top-k log-probabilities plus the sampled token's own;
    ``prompt_logprobs=k`` the same per prompt token (the first is None). Both are the model's raw
    log-probabilities (log-softmax of the logits in float32, before temperature, top-k and
    top-p: vLLM's default "raw_logprobs"). ``skip_special_tokens`` drops special tokens from
    ``.text``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    stop: str | Sequence[str] = ()
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        # Frozen: normalise through object.__setattr__ so a list argument becomes a hashable tuple.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        self._verify_sampling()
        self._verify_stopping()
        self._verify_outputs()
        self._verify_seed()
        self._verify_logit_bias()

    def _verify_sampling(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name}={value!r} must be a number")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(
                f"temperature={self.temperature} must be a finite number >= 0 "
                "(0 means greedy decoding)"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to disable top-p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k={self.top_k!r} must be an integer >= 1, or 0 / -1 to disable top-k"
            )

    def _verify_stopping(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        bad = [
            token
            for token in self.stop_token_ids
            if isinstance(token, bool) or not isinstance(token, int) or token < 0
        ]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative integers; got {bad}")
        bad_stop = [text for text in self.stop if not isinstance(text, str) or not text]
        if bad_stop:
            raise ValueError(f"stop must be non-empty strings; got {bad_stop!r}")

    def _verify_outputs(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1 (completions per prompt)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise ValueError(
                    f"{name}={value!r} must be None or an integer >= 0 (how many top "
                    "log-probabilities to return per token; 0: only the chosen token's)"
                )
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens={self.skip_special_tokens!r} must be a bool")
        constraint = self.structured_outputs
        if constraint is not None and not isinstance(constraint, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs={constraint!r} must be a StructuredOutputsParams "
                "(json=, regex=, choice=, grammar= or json_object=True)"
            )

    def _verify_seed(self) -> None:
        seed = self.seed
        if seed is None:
            return
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed={seed!r} must be an integer or None")
        # Completion i of n samples with seed + i: the last one must fit too.
        if not MIN_SEED <= seed <= seed + self.n - 1 <= MAX_SEED:
            raise ValueError(
                f"seed={seed} must be in [-2**63, 2**64 - 1] (what torch.Generator takes), and "
                f"so must seed + n - 1 (completion i of n samples with seed + i; n={self.n})"
            )

    def _verify_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(
                f"logit_bias={self.logit_bias!r} must be a dict of token id -> bias, or None"
            )
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias={{{token!r}: ...}}: token ids are integers >= 0")
            if (
                isinstance(bias, bool)
                or not isinstance(bias, numbers.Real)
                or not -100.0 <= bias <= 100.0
            ):
                raise ValueError(
                    f"logit_bias={{{token}: {bias!r}}}: a bias is a number in [-100, 100]"
                )
        # A private copy: the caller's dict may change after the request is made.
        object.__setattr__(
            self, "logit_bias", {t: float(b) for t, b in self.logit_bias.items()} or None
        )

    def check_vocabulary(self, vocab_size: int) -> None:
        """``logprobs`` and ``prompt_logprobs`` ask for at most the whole vocabulary, and
        ``logit_bias`` names tokens of it (checked once the model is known)."""
        outside = [token for token in self.logit_bias or () if token >= vocab_size]
        if outside:
            raise ValueError(
                f"logit_bias names token ids {outside[:5]} outside this model's vocabulary of "
                f"{vocab_size} tokens (ids 0 to {vocab_size - 1})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(
                    f"{name}={value} is more than this model's vocabulary of {vocab_size} "
                    f"tokens; ask for at most {vocab_size}"
                )

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes by argmax (temperature 0 or below ``SAMPLING_EPS``)."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0
