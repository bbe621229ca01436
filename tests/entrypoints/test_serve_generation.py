"""``Generation``, the server's side of a request's choices, over a fake engine client (no model).

Proves: a reader that fell behind several engine turns gets one merged delta per choice whose
text, token ids, log-probabilities and finish reason equal those of a reader that took every
turn on its own (also when a stop string spans the merged deltas: the text is cut before it,
the engine gets one ``StopRequest``, and tokens still in flight after it are dropped); the reader
wakes once per engine turn with every choice that changed in that turn; the detokenizer runs
once per turn for all streams (``TextBatch``), not once per delta; the server-sent events of one
wake (every choice's chunk) go out as one write, each chunk a ``data:`` line of its own.
Run: pytest tests/entrypoints/test_serve_generation.py
"""

from __future__ import annotations

import asyncio
import json
import types

import pytest

pytest.importorskip("fastapi")

from pieceworks.engine.async_engine import AsyncLLMEngine  # noqa: E402
from pieceworks.engine.messages import (  # noqa: E402
    EngineCommand,
    EngineCoreOutputs,
    EngineStats,
    RequestDelta,
    StopRequest,
)
from pieceworks.entrypoints.serve.generation import ChoiceSpec, Generation  # noqa: E402
from pieceworks.entrypoints.serve.metrics import ServerMetrics  # noqa: E402
from pieceworks.entrypoints.serve.serving import ChunkStream, ResponseFormat  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402


class FakeClient:
    """Records commands; the test plays the engine by calling ``on_outputs``."""

    max_num_seqs = 4
    initial_stats = EngineStats(num_blocks=10, num_free_blocks=10)

    def __init__(self) -> None:
        self.commands: list[EngineCommand] = []

    def start(self, loop, on_outputs) -> None:
        self.on_outputs = on_outputs

    def send(self, command: EngineCommand) -> None:
        self.commands.append(command)

    def is_alive(self) -> bool:
        return True

    def shutdown(self, timeout) -> None:
        pass


class ByteTokenizer:
    """Token i is byte i; counts its decode calls."""

    def __init__(self) -> None:
        self.num_calls = 0

    def decode(self, ids: list[int], **options) -> str:
        self.num_calls += 1
        return bytes(ids).decode("utf-8", errors="replace")


TEXT = "héllo wörld STOP"
TOKENS = list(TEXT.encode("utf-8")) + list(b" in flight")


async def run(num_choices: int, stop: list[str], read_every_turn: bool, tokenizer=None):
    """One token per turn for each choice; the reader's batches, results and the commands."""
    client = FakeClient()
    engine = AsyncLLMEngine(client, max_waiting_requests=4)
    engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=len(TOKENS), stop=stop, logprobs=0)
    specs = [ChoiceSpec([1, 2], params) for _ in range(num_choices)]
    generation = Generation(engine, specs, tokenizer or ByteTokenizer(), ServerMetrics("m"))

    def turn(step: int) -> None:
        last = step == len(TOKENS) - 1
        deltas = [
            RequestDelta(
                f"{generation.request_id}-{i}",
                [TOKENS[step]],
                step + 1,
                finish_reason="length" if last else None,
                logprobs=[f"lp{step}"],
            )
            for i in range(num_choices)
        ]
        client.on_outputs([EngineCoreOutputs(deltas, None)])

    starting = asyncio.ensure_future(generation.start())
    await asyncio.sleep(0)
    turn(0)
    await starting
    batches = generation.stream_batches()
    got = []
    if read_every_turn:
        got.append(await anext(batches))
        for step in range(1, len(TOKENS)):
            if all(result.finish_reason for result in generation.results):
                break
            turn(step)
            got.append(await anext(batches))
        await batches.aclose()
    else:
        for step in range(1, len(TOKENS)):
            turn(step)
        got = [batch async for batch in batches]
    return got, generation.results, client.commands


def outcome(batches, results):
    texts = ["".join(d.text for batch in batches for d in batch if d.index == i) for i in (0,)]
    tokens = [t for batch in batches for d in batch if d.index == 0 for t in d.token_ids]
    logprobs = [e for batch in batches for d in batch if d.index == 0 for e in d.logprobs or []]
    return texts[0], tokens, logprobs, results[0].finish_reason, results[0].text


@pytest.mark.parametrize("stop", [[], ["STOP"], ["ld ST"]])
def test_a_reader_behind_gets_one_merged_delta_with_the_same_output(stop):
    each, each_results, each_commands = asyncio.run(run(1, stop, read_every_turn=True))
    merged, merged_results, merged_commands = asyncio.run(run(1, stop, read_every_turn=False))
    assert len(merged) == 1 and len(merged[0]) == 1  # one wake, one delta
    assert len(each) > 1
    assert outcome(merged, merged_results) == outcome(each, each_results)
    text, tokens, logprobs, finish_reason, _ = outcome(merged, merged_results)
    if stop:
        assert text == TEXT[: TEXT.index(stop[0])] and finish_reason == "stop"
        assert len(tokens) == len(TEXT[: TEXT.index(stop[0])].encode()) + len(stop[0].encode())
        for commands in (each_commands, merged_commands):
            assert sum(isinstance(c, StopRequest) for c in commands) == 1
    else:
        assert text == TEXT + " in flight" and finish_reason == "length"
        assert tokens == TOKENS
    assert logprobs == [f"lp{step}" for step in range(len(tokens))]


def test_the_reader_wakes_once_per_turn_with_every_choice():
    tokenizer = ByteTokenizer()
    batches, results, _ = asyncio.run(run(3, [], read_every_turn=True, tokenizer=tokenizer))
    assert len(batches) == len(TOKENS)
    assert all(sorted(d.index for d in batch) == [0, 1, 2] for batch in batches)
    assert [r.text for r in results] == [TEXT + " in flight"] * 3
    # The fake tokenizer is not a fast tokenizer: two decodes per token and stream, all made in
    # the turn's one batch (a choice never decodes on its own).
    assert tokenizer.num_calls == 2 * 3 * len(TOKENS)


def test_the_events_of_one_wake_go_out_as_one_write():
    async def run_events():
        client = FakeClient()
        engine = AsyncLLMEngine(client, max_waiting_requests=4)
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=3)
        specs = [ChoiceSpec([1], params), ChoiceSpec([1], params)]
        metrics = ServerMetrics("m")
        generation = Generation(engine, specs, ByteTokenizer(), metrics)
        starting = asyncio.ensure_future(generation.start())
        await asyncio.sleep(0)
        for step, token in enumerate(b"abc"):
            reason = "length" if step == 2 else None
            deltas = [
                RequestDelta(f"{generation.request_id}-{i}", [token], step + 1, reason)
                for i in range(2)
            ]
            client.on_outputs([EngineCoreOutputs(deltas, None)])
        await starting
        fmt = ResponseFormat(
            "cmpl",
            lambda d: [json.dumps({"index": d.index, "text": d.text})],
            lambda num_choices: [],
            lambda header, results: {},
        )
        ctx = types.SimpleNamespace(metrics=metrics)
        header = {"id": "x", "created": 0, "model": "m"}  # as ``respond`` builds it
        chunks = ChunkStream(ctx, generation, fmt, header, False)  # type: ignore[arg-type]
        return chunks.take(), chunks.ended

    write, ended = asyncio.run(run_events())
    assert ended and write.endswith(b"data: [DONE]\n\n")  # every turn in one write
    events = write.decode().split("\n\n")[:-2]
    chunks = [json.loads(event.removeprefix("data: ")) for event in events]
    assert all(c["id"] == "x" and c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0] for c in chunks] == [
        {"index": 0, "text": "abc"},
        {"index": 1, "text": "abc"},
    ]
