"""Structured output: xgrammar grammars, one matcher per constrained request, the token bitmask.

A request whose ``SamplingParams.structured_outputs`` is set may only sample tokens that keep its
output inside a grammar (a JSON schema, a regex, a choice of strings, an EBNF grammar, any JSON
object). ``StructuredOutputManager`` belongs to the engine core, beside the scheduler (vLLM's
placement): it compiles each grammar once per engine, cached by (kind, spec), with a
``GrammarCompiler`` built lazily from the engine's tokenizer (its vocabulary padded to the
model's logits); it keeps one ``GrammarMatcher`` per running constrained request, brings it up
to the request's output tokens before each step (accepting the new ones, rolling back any the
scheduler dropped), and writes the step's ``grammar_bitmask``: one row per producing request,
all bits set for a free row (from ``BATCH_FILL_MIN_ROWS`` constrained rows on, xgrammar fills them
on several threads). The runner applies that bitmask to the logits where the host
sampler runs (``GrammarMask``: one pinned copy to the device, one masking kernel); a
request whose matcher terminates (it accepted a stop token) finishes with reason "stop".

Preemption keeps a request's generated tokens (recompute preemption), so its matcher stays valid;
the sync by token count also covers tokens dropped after a stop.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pieceworks.logger import init_logger
from pieceworks.sampling_params import StructuredOutputsParams
from pieceworks.scheduler.output import SchedulerOutput
from pieceworks.scheduler.request import Request

logger = init_logger(__name__)

# The most whitespace characters JSON may put between two tokens (xgrammar's
# ``max_whitespace_cnt``): enough for indented output, and a model that keeps choosing
# whitespace cannot run to max_tokens inside it.
MAX_JSON_WHITESPACE = 16
# From this many constrained rows a step's bitmask is filled by xgrammar's BatchGrammarMatcher on
# several threads; fewer rows are filled one by one. A row costs about 10 us in a JSON string on
# one core of the CI machine, while each batched call starts its threads: about 100 us there with
# two, and at 8 rows on the H100's host (8 threads) 306 us a step against about 80 one by one
# (``profile_host.py --json-schema``, "grammar"). vLLM parallelises from 128 rows too.
BATCH_FILL_MIN_ROWS = 128
# Devices whose logits xgrammar masks in one kernel (its CPU loop, its Triton kernel on CUDA).
XGRAMMAR_MASK_DEVICES = ("cpu", "cuda")
# xgrammar prefixes its errors with "[time] /path/file.cc:line: "; the rest is the reason.
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


def _xgrammar() -> Any:
    import xgrammar

    return xgrammar


def grammar_error(error: Exception) -> str:
    """xgrammar's reason for refusing a grammar, without its source location."""
    return _XGRAMMAR_PREFIX.sub("", str(error).strip()).splitlines()[0]


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a JSON-escaped literal)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def check_grammar(constraint: StructuredOutputsParams) -> None:
    """Parse ``constraint`` without a tokenizer; ValueError naming the problem if xgrammar
    cannot (the server calls this before a request reaches the engine)."""
    xgr = _xgrammar()
    kind = constraint.kind
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(constraint.json)
        elif kind == "regex":
            xgr.Grammar.from_regex(constraint.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(constraint.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(constraint.choice or ()))
    except Exception as error:  # xgrammar raises RuntimeError (and ValueError) for bad specs
        name = "json schema" if kind == "json" else kind
        raise ValueError(f"the {name} does not compile: {grammar_error(error)}") from None


@dataclasses.dataclass
class _RequestGrammar:
    """One request's matcher and how many of its output tokens it has accepted."""

    matcher: Any
    num_accepted: int = 0
    failed: bool = False


class StructuredOutputManager:
    """Compiled grammars of one engine and the matchers of its constrained requests."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        # The thread building the compiler (``build_compiler_in_background``) and its error.
        self._builder: threading.Thread | None = None
        self._build_error: BaseException | None = None
        self._compiled: dict[tuple[str, str, bool], Any] = {}
        self._grammars: dict[str, _RequestGrammar] = {}
        self._batch_matcher: Any = None  # xgrammar's threaded filler, built on first use

    @property
    def compiler(self) -> Any:
        """The engine's ``GrammarCompiler``, built on first use from its tokenizer (or by the
        background build, which this waits for)."""
        self._join_builder()
        if self._compiler is None:
            self._compiler = self._build_compiler()
        return self._compiler

    @property
    def compiler_ready(self) -> bool:
        """Whether a grammar compiles now without building the compiler first."""
        return self._compiler is not None

    @property
    def compiler_building(self) -> bool:
        """Whether the background build of the compiler is still running."""
        return self._builder is not None and self._builder.is_alive()

    def build_compiler_in_background(self) -> None:
        """Start building the compiler on a thread of its own (loading the tokenizer and
        reading its vocabulary takes seconds), unless it is built or being built; ``compiler``
        waits for it and raises its error, if it failed."""
        if self._compiler is not None or self._builder is not None:
            return
        self._builder = threading.Thread(
            target=self._build_in_background, name="pieceworks-grammar-compiler", daemon=True
        )
        self._builder.start()

    def wait_for_compiler(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the background build to end."""
        if self._builder is not None:
            self._builder.join(timeout)

    def _build_in_background(self) -> None:
        try:
            self._compiler = self._build_compiler()
        except BaseException as error:  # raised again on the engine's thread by ``compiler``
            self._build_error = error

    def _join_builder(self) -> None:
        """Wait for the background build, if one ran; raise its error once (a later use
        tries again, as a failed build on first use does)."""
        if self._builder is None:
            return
        self._builder.join()
        self._builder, error, self._build_error = None, self._build_error, None
        if error is not None:
            raise error

    def _build_compiler(self) -> Any:
        xgr = _xgrammar()
        tokenizer = self._load_tokenizer()
        if tokenizer is None:
            raise ValueError(
                "structured output needs the model's tokenizer, and this model has none "
                "(presets have random weights): pass --tokenizer (offline: tokenizer=) "
                "naming a directory, a GGUF file or smollm2-135m of the model's vocabulary"
            )
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=self.vocab_size,
            stop_token_ids=self.stop_token_ids or None,
        )
        return xgr.GrammarCompiler(info)

    def compile(self, constraint: StructuredOutputsParams) -> Any:
        """The ``CompiledGrammar`` of ``constraint`` (compiled once per engine); ValueError
        naming the problem when it does not compile."""
        key = constraint.key
        compiled = self._compiled.get(key)
        if compiled is None:
            check_grammar(constraint)
            try:
                compiled = self._compile(constraint)
            except Exception as error:
                raise ValueError(
                    f"the {constraint.kind} does not compile: {grammar_error(error)}"
                ) from None
            self._compiled[key] = compiled
        return compiled

    def _compile(self, constraint: StructuredOutputsParams) -> Any:
        compiler, kind = self.compiler, constraint.kind
        any_whitespace = not constraint.disable_any_whitespace
        whitespace = MAX_JSON_WHITESPACE if any_whitespace else None
        if kind == "json":
            return compiler.compile_json_schema(
                constraint.json, any_whitespace=any_whitespace, max_whitespace_cnt=whitespace
            )
        if kind == "json_object":
            schema = json.dumps({"type": "object"})
            return compiler.compile_json_schema(
                schema, any_whitespace=any_whitespace, max_whitespace_cnt=whitespace
            )
        if kind == "regex":
            return compiler.compile_regex(constraint.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_ebnf(constraint.choice or ()))
        return compiler.compile_grammar(constraint.grammar)

    # --- per step -----------------------------------------------------------------------------
    def grammar_bitmask(self, output: SchedulerOutput) -> torch.Tensor | None:
        """The step's bitmask ``(S, ceil(V / 32))`` int32 over its producing requests, or None
        when none of them is constrained. Free rows, and rows whose grammar has ended (a token
        sampled after the stop, which the scheduler drops), allow every token."""
        rows = [scheduled.request for scheduled in output.producing_requests]
        if not any(request.sampling_params.structured_outputs for request in rows):
            return None
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # all bits set
        matchers, indices = [], []
        for row, request in enumerate(rows):
            if request.is_finished:  # stopped on the previous step's token: this one is dropped
                continue
            grammar = self._synced(request)
            if grammar is not None and not grammar.failed and not grammar.matcher.is_terminated():
                matchers.append(grammar.matcher)
                indices.append(row)
        if len(matchers) >= BATCH_FILL_MIN_ROWS:  # xgrammar's threads, half the host's cores
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        else:
            for matcher, row in zip(matchers, indices, strict=True):
                matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def finished_requests(self, requests: Sequence[Request]) -> list[Request]:
        """The unfinished requests among ``requests`` whose grammar has ended (the matcher
        accepted a stop token) or refused a token, after accepting their new output tokens."""
        ended = []
        for request in requests:
            if request.is_finished or not request.sampling_params.structured_outputs:
                continue
            grammar = self._synced(request)
            if grammar is not None and (grammar.failed or grammar.matcher.is_terminated()):
                ended.append(request)
        return ended

    def release(self, request_id: str) -> None:
        """Forget a finished request's matcher."""
        self._grammars.pop(request_id, None)

    def _synced(self, request: Request) -> _RequestGrammar | None:
        """``request``'s matcher, made on first use, having accepted exactly its output
        tokens (the new ones accepted, any the scheduler dropped rolled back)."""
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return None
        grammar = self._grammars.get(request.request_id)
        if grammar is None:
            matcher = _xgrammar().GrammarMatcher(self.compile(constraint))
            grammar = self._grammars[request.request_id] = _RequestGrammar(matcher)
        tokens = request.output_token_ids
        if grammar.num_accepted > len(tokens):
            grammar.matcher.rollback(grammar.num_accepted - len(tokens))
            grammar.num_accepted = len(tokens)
        for token_id in tokens[grammar.num_accepted :]:
            if grammar.failed or grammar.matcher.is_terminated():
                break
            if not grammar.matcher.accept_token(token_id):
                logger.warning(
                    "request %s: its grammar refused token %d; finishing it",
                    request.request_id,
                    token_id,
                )
                grammar.failed = True
                break
            grammar.num_accepted += 1
        return grammar


# Gives a step's token bitmask ``(S, ceil(V / 32))`` (or None: nothing to mask); the runner calls
# it once per step, after launching the forward (``ModelRunner.execute_async``).
GrammarSource = Callable[[], "torch.Tensor | None"]


class GrammarMask:
    """The runner's side of structured output: each constrained step's bitmask applied to its
    logits (``apply_grammar_bitmask``) through one of two pinned host buffers, alternating by
    step as the sampled tokens' staging does (the other may still be copying to the device);
    allocated on the first constrained step, and not at all where memory is not pinned."""

    def __init__(self, pin_memory: bool, max_rows: int) -> None:
        self.pin_memory = pin_memory
        self.max_rows = max_rows  # logits rows a step can have
        self._staging: list[torch.Tensor] = []

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, step: int) -> None:
        """Mask ``logits`` ``(S, V)`` by ``bitmask`` ``(S, ceil(V / 32))`` for step ``step``."""
        apply_grammar_bitmask(logits, bitmask, self._staging_for(bitmask, step))

    def stage(self, bitmask: torch.Tensor, step: int, device_bitmask: torch.Tensor) -> None:
        """Copy ``bitmask`` ``(S, W)`` into the first rows of ``device_bitmask``, the masked
        decode tail's static buffer, for step ``step`` (asynchronous from pinned memory)."""
        staging = self._staging_for(bitmask, step)
        rows = device_bitmask[: bitmask.shape[0], : bitmask.shape[1]]
        if staging is None:
            rows.copy_(bitmask)
            return
        words = staging[: bitmask.shape[0], : bitmask.shape[1]]
        words.copy_(bitmask)
        rows.copy_(words, non_blocking=True)

    def _staging_for(self, bitmask: torch.Tensor, step: int) -> torch.Tensor | None:
        """Step ``step``'s pinned buffer (None where memory is not pinned)."""
        if not self.pin_memory:
            return None
        if not self._staging:
            shape = (max(self.max_rows, bitmask.shape[0]), bitmask.shape[1])
            self._staging = [
                torch.empty(shape, dtype=bitmask.dtype, pin_memory=True) for _ in range(2)
            ]
        return self._staging[step % 2]


def apply_grammar_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, staging: torch.Tensor | None = None
) -> None:
    """Set ``logits`` ``(S, V)`` to -inf where ``bitmask`` ``(S, ceil(V / 32))`` has a 0 bit
    (bit ``j % 32`` of word ``j // 32`` allows token ``j``), in place, on the logits' device.

    ``staging``, pinned host memory of at least the bitmask's shape, makes the one
    host-to-device copy asynchronous (from pageable memory the host would wait for it). On a
    CPU or CUDA device xgrammar's kernel masks in one launch (its Triton kernel on CUDA); on any
    other device torch ops do, which are its reference.
    """
    words = bitmask
    if staging is not None and logits.device.type != "cpu":
        words = staging[: bitmask.shape[0], : bitmask.shape[1]]
        words.copy_(bitmask)
    words = words.to(logits.device, non_blocking=True)
    vocab_size = min(logits.shape[1], words.shape[1] * 32)
    if logits.device.type in XGRAMMAR_MASK_DEVICES and logits.is_contiguous():
        _xgrammar().apply_token_bitmask_inplace(logits, words, vocab_size=vocab_size)
        return
    mask_logits_reference(logits, words)


def mask_logits_reference(logits: torch.Tensor, words: torch.Tensor) -> None:
    """``apply_grammar_bitmask`` in torch ops, ``words`` on the logits' device."""
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = (words.unsqueeze(-1) >> shifts) & 1  # (S, W, 32)
    allowed = allowed.view(num_rows, -1)[:, :vocab_size].bool()
    logits.masked_fill_(~allowed, float("-inf"))
