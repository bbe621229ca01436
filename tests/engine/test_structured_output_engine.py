"""Structured output in the engine: constrained and free requests in one batch, on llama-tiny.

Proves (random weights, the 256-token byte tokenizer, async scheduling and 4 scheduler steps):
a free request's greedy tokens are the same with or without a constrained request beside it
(the mask touches only constrained rows; the batch falls back from multi-step, which the free
run uses, and the tokens still match); each constrained output is in its grammar's language
(a choice, a regex, a bounded JSON schema) and ends on EOS with reason "stop";
``num_constrained_steps`` counts the steps that held one; each constrained step's bitmask is
filled after the runner has launched that step's logits, and the previous step's tokens are
applied inside that call (the host fills the bitmask while the device runs the forward); a
grammar that does not compile is refused when the request is added. Through the engine loop
(``defer_grammar``) the first constrained request does not hold the other requests while the
grammar compiler is built: a free request runs to its end meanwhile, the constrained one then
gives the tokens the synchronous path gives, an abort while waiting ends it, a grammar that
fails after the build comes back as the request's error, and a failed build refuses every
waiting request with its reason, built once. With static graphs
(FULL_AND_PIECEWISE on simgraph, or the GPU's: ``platform_agnostic``) and async scheduling, the
constrained steps replay the FULL decode graph, mask on the host sampler, and leave a free
neighbour's greedy tokens (sampled in decode tails when alone) as they were; a greedy batch that
fills a FULL decode graph samples its constrained rows in the masked decode tail, with the host
sampler's tokens.
Run: pytest tests/engine/test_structured_output_engine.py
"""

from __future__ import annotations

import json
import re
import threading

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")

from pieceworks.engine.core_loop import EngineCoreLoop  # noqa: E402
from pieceworks.engine.grammar_waitlist import GrammarWaitlist  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.engine.messages import AbortRequest, AddRequest  # noqa: E402
from pieceworks.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from pieceworks.worker.structured_output import StructuredOutputManager  # noqa: E402
from tests.engine.tiny_tokenizer import save_tiny_tokenizer  # noqa: E402

FREE_PROMPTS = [[5, 17, 42, 99, 3], [7, 7, 200, 31]]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    tokenizer = save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return LLM("llama-tiny", enforce_eager=True, dtype="float32", max_num_seqs=8,
               num_scheduler_steps=4, tokenizer=tokenizer)  # fmt: skip


def free_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def constrained(constraint: StructuredOutputsParams, **options) -> SamplingParams:
    return SamplingParams(max_tokens=200, structured_outputs=constraint, **options)


def test_free_tokens_unchanged_and_constrained_outputs_valid(llm):
    alone = [o.outputs[0].token_ids for o in llm.generate(FREE_PROMPTS, free_params())]
    steps_before = llm.engine.num_constrained_steps
    mixed = llm.generate(
        [*FREE_PROMPTS, "a", "b", "c", "d"],
        [
            free_params(),
            free_params(),
            constrained(StructuredOutputsParams(choice=["yes", "no"]), temperature=0.0),
            constrained(StructuredOutputsParams(regex=r"[0-9]{2}-[a-c]"), seed=1),
            constrained(StructuredOutputsParams(json=SCHEMA), seed=2),
            constrained(StructuredOutputsParams(json_object=True), temperature=0.0),
        ],
    )
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    choice, regex, schema, json_object = (o.outputs[0] for o in mixed[2:])
    assert choice.text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{2}-[a-c]", regex.text)
    value = json.loads(schema.text)
    assert set(value) == {"color", "size"} and value["color"] in ("red", "green")
    assert isinstance(value["size"], int) and 0 <= value["size"] <= 9
    for output in (choice, regex, schema):
        assert output.finish_reason == "stop" and output.token_ids[-1] == 2  # EOS
    assert json_object.finish_reason in ("stop", "length")
    assert json_object.text.startswith("{")
    assert llm.engine.num_constrained_steps > steps_before


def test_a_bad_grammar_is_refused_when_added(llm):
    with pytest.raises(ValueError, match="regex does not compile"):
        llm.generate(["a"], constrained(StructuredOutputsParams(regex="a(b")))


def test_the_bitmask_is_filled_after_the_step_is_launched(llm, monkeypatch):
    engine, events = llm.engine, []
    assert engine.async_scheduling
    runner = engine.executor.runner
    real_logits, real_finish = runner.model.compute_logits, engine._finish_in_flight
    real_bitmask = engine.structured_output.grammar_bitmask

    def compute_logits(hidden_states):
        events.append("logits")
        return real_logits(hidden_states)

    def finish_in_flight():
        events.append("finish" if engine._in_flight is not None else "nothing in flight")
        return real_finish()

    def grammar_bitmask(output):
        events.append("bitmask")
        return real_bitmask(output)

    monkeypatch.setattr(runner.model, "compute_logits", compute_logits)
    monkeypatch.setattr(engine, "_finish_in_flight", finish_in_flight)
    monkeypatch.setattr(engine.structured_output, "grammar_bitmask", grammar_bitmask)
    choice = StructuredOutputsParams(choice=["yellow", "green"])
    (out,) = llm.generate(["a"], constrained(choice, temperature=0.0))
    assert out.outputs[0].text in ("yellow", "green")
    steps = "".join(
        "L" if e == "logits" else "B" if e == "bitmask" else "F" if e == "finish" else "-"
        for e in events
    )
    # Each constrained step: its logits launched (L), then the step before it finished (F; the
    # first step has none in flight: -), then its bitmask filled (B); the engine's own finish
    # after the launch finds nothing left (-); the last step is finished when the run drains.
    assert re.fullmatch(r"L-B-(LFB-)+F", steps), steps


@pytest.mark.platform_agnostic
def test_constrained_steps_under_static_graphs(graph_platform, tmp_path):
    from pieceworks.benchmarks.modes import compilation_for_mode
    from pieceworks.core.config import CUDAGraphMode
    from tests.engine.test_host_path import save_scaled_llama_tiny

    checkpoint = save_scaled_llama_tiny(tmp_path / "llama-tiny")
    tokenizer = save_tiny_tokenizer(tmp_path / "tokenizer")
    compilation = compilation_for_mode("full_and_piecewise", {"backend": "eager"})
    llm = LLM(checkpoint, compilation_config=compilation, dtype="float32", max_num_seqs=4,
              tokenizer=tokenizer)  # fmt: skip
    assert llm.engine.async_scheduling
    free = [free_params(), free_params()]
    alone = [o.outputs[0].token_ids for o in llm.generate(FREE_PROMPTS, free)]
    runner, modes = llm.engine.runner, []
    real_run_model = runner._run_model
    runner._run_model = lambda step: modes.append(step.mode) or real_run_model(step)
    choice = StructuredOutputsParams(choice=["yellow", "green"])
    mixed = llm.generate(
        [*FREE_PROMPTS, "a", "b"],
        [*free, constrained(choice, temperature=0.0),
         constrained(StructuredOutputsParams(json=SCHEMA), temperature=0.0)],
    )  # fmt: skip
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert mixed[2].outputs[0].text in ("yellow", "green")
    value = json.loads(mixed[3].outputs[0].text)
    assert set(value) == {"color", "size"} and value["color"] in ("red", "green")
    assert llm.engine.num_constrained_steps > 0
    assert CUDAGraphMode.FULL in modes  # constrained decode steps replayed the FULL graph
    llm.shutdown()


@pytest.mark.platform_agnostic
def test_constrained_greedy_steps_sample_in_the_masked_tail(graph_platform, tmp_path):
    """A greedy batch that fills a FULL decode graph, constrained rows in it, samples in the
    masked decode tail (the bitmask staged into its static buffer; simgraph's replay re-runs the
    tail on that buffer) and gives the host sampler's tokens, constrained and free alike."""
    from pieceworks.benchmarks.modes import compilation_for_mode
    from tests.engine.test_host_path import save_scaled_llama_tiny

    checkpoint = save_scaled_llama_tiny(tmp_path / "llama-tiny")
    tokenizer = save_tiny_tokenizer(tmp_path / "tokenizer")
    compilation = compilation_for_mode("full_and_piecewise", {"backend": "eager"})
    prompts = [*FREE_PROMPTS, "a", "b"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        constrained(StructuredOutputsParams(json=SCHEMA), temperature=0.0),
        constrained(StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{4}"), temperature=0.0),
    ]
    outputs, masked_runs = {}, []

    def counted(tail):
        return lambda hidden: masked_runs.append(1) or tail(hidden)

    for tails in (False, True):
        llm = LLM(checkpoint, compilation_config=compilation, dtype="float32", max_num_seqs=4,
                  tokenizer=tokenizer)  # fmt: skip
        graphs = llm.engine.runner.graphs
        if not tails:
            graphs.decode_tail_descriptors = set()  # every step masks and samples by launches
        graphs.masked_decode_tail = counted(graphs.masked_decode_tail)
        completions = [o.outputs[0] for o in llm.generate(prompts, params)]
        outputs[tails] = [c.token_ids for c in completions]
        assert bool(masked_runs) == tails
        texts = [c.text for c in completions[2:]]
        llm.shutdown()
    assert outputs[True] == outputs[False]
    value = json.loads(texts[0])
    assert set(value) == {"color", "size"} and value["color"] in ("red", "green")
    assert re.fullmatch(r"[0-9]{3}-[a-c]{4}", texts[1])


@pytest.fixture
def slow_compiler(llm, monkeypatch):
    """A fresh grammar compiler for ``llm``'s engine whose tokenizer loads only once the
    returned event is set (as loading a real tokenizer's vocabulary takes seconds)."""
    engine, release = llm.engine, threading.Event()
    real = engine.structured_output

    def load_tokenizer():
        assert release.wait(60)
        return real._load_tokenizer()

    manager = StructuredOutputManager(load_tokenizer, real.vocab_size, real.stop_token_ids)
    monkeypatch.setattr(engine, "structured_output", manager)
    monkeypatch.setattr(engine, "grammar_waitlist", GrammarWaitlist(manager))
    yield release
    release.set()


def run_until(loop: EngineCoreLoop, done) -> dict[str, list]:
    """Step ``loop`` until ``done(deltas)``; every delta so far, by request."""
    deltas: dict[str, list] = {}
    for _ in range(10_000):
        for delta in loop.take_outputs().deltas:
            deltas.setdefault(delta.request_id, []).append(delta)
        if done(deltas):
            return deltas
        loop.step()
    raise AssertionError(f"not done: {deltas}")


def finished(deltas, request_id: str) -> bool:
    return any(d.finished for d in deltas.get(request_id, []))


def test_the_first_constrained_request_does_not_hold_the_loop(llm, slow_compiler):
    choice = constrained(StructuredOutputsParams(choice=["yes", "no"]), temperature=0.0)
    engine, loop = llm.engine, EngineCoreLoop(llm.engine)
    loop.apply(AddRequest("c", [5, 6, 7], choice))
    loop.apply(AddRequest("f", FREE_PROMPTS[0], free_params()))
    deltas = run_until(loop, lambda deltas: finished(deltas, "f"))
    assert "c" not in deltas  # still waiting: the compiler is being built
    assert engine.structured_output.compiler_building and loop.stats().num_waiting == 1
    slow_compiler.set()
    busy = engine.has_unfinished_requests
    deltas.update(run_until(loop, lambda deltas: finished(deltas, "c") and not busy()))
    assert deltas["c"][-1].finish_reason == "stop"
    # the same requests offline, where adding a constrained request compiles its grammar
    (free, sync) = llm.generate([FREE_PROMPTS[0], [5, 6, 7]], [free_params(), choice])
    assert [t for d in deltas["f"] for t in d.new_token_ids] == free.outputs[0].token_ids
    assert [t for d in deltas["c"] for t in d.new_token_ids] == sync.outputs[0].token_ids


def test_an_abort_while_waiting_for_the_compiler_ends_the_request(llm, slow_compiler):
    loop = EngineCoreLoop(llm.engine)
    loop.apply(AddRequest("c", [5, 6, 7], constrained(StructuredOutputsParams(regex="[ab]+"))))
    loop.apply(AbortRequest("c"))
    (delta,) = loop.take_outputs().deltas
    assert delta.finish_reason == "abort" and not delta.new_token_ids
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_failing_after_the_build_is_the_requests_error(llm, slow_compiler, monkeypatch):
    manager, loop = llm.engine.structured_output, EngineCoreLoop(llm.engine)

    def refuse(constraint):
        raise ValueError("the regex does not compile: refused after the build")

    loop.apply(AddRequest("c", [5, 6, 7], constrained(StructuredOutputsParams(regex="[ab]+"))))
    monkeypatch.setattr(manager, "compile", refuse)
    slow_compiler.set()
    busy = llm.engine.has_unfinished_requests
    deltas = run_until(loop, lambda deltas: finished(deltas, "c") and not busy())
    (delta,) = deltas["c"]
    assert delta.error == "the regex does not compile: refused after the build"
    assert not delta.engine_failed


def test_a_failed_compiler_build_refuses_every_waiting_request_once(llm, monkeypatch):
    engine, calls = llm.engine, []
    real = engine.structured_output

    def no_tokenizer():
        calls.append(1)
        return None

    manager = StructuredOutputManager(no_tokenizer, real.vocab_size, real.stop_token_ids)
    monkeypatch.setattr(engine, "structured_output", manager)
    monkeypatch.setattr(engine, "grammar_waitlist", GrammarWaitlist(manager))
    loop = EngineCoreLoop(engine)
    for request_id in ("a", "b"):
        loop.apply(AddRequest(request_id, [5, 6], constrained(StructuredOutputsParams(regex="a"))))
    busy = engine.has_unfinished_requests
    deltas = run_until(loop, lambda d: finished(d, "a") and finished(d, "b") and not busy())
    for request_id in ("a", "b"):
        (delta,) = deltas[request_id]
        assert delta.error.startswith("structured output needs the model's tokenizer")
    assert calls == [1]  # built once, on the thread
