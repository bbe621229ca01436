"""``StructuredOutputManager`` and ``apply_grammar_bitmask`` on a 256-token byte tokenizer.

Proves: a choice grammar's first bitmask allows exactly the first bytes of its choices, and
``apply_grammar_bitmask`` leaves those logits and sets the rest to -inf; the matcher follows the
request's output tokens (new ones accepted, dropped ones rolled back) and a finished grammar
allows only EOS, after which the request is reported finished; a free row allows everything;
from ``BATCH_FILL_MIN_ROWS`` constrained rows xgrammar's threaded filler gives the same bitmask
as filling the rows one by one; xgrammar's one-kernel masking equals the torch reference on
every dtype, through pinned staging and without, with the vocabulary padded past the bitmask;
equal constraints compile once; a bad regex, schema or grammar is refused naming the problem,
with and without a tokenizer (``check_grammar``).
Run: pytest tests/worker/test_structured_output.py
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")

from pieceworks.engine.tokenizer import load_tokenizer  # noqa: E402
from pieceworks.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from pieceworks.scheduler.output import ScheduledRequest, SchedulerOutput  # noqa: E402
from pieceworks.scheduler.request import Request  # noqa: E402
from pieceworks.worker.structured_output import (  # noqa: E402
    BATCH_FILL_MIN_ROWS,
    StructuredOutputManager,
    apply_grammar_bitmask,
    check_grammar,
    mask_logits_reference,
)
from tests.engine.tiny_tokenizer import save_tiny_tokenizer  # noqa: E402

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture
def manager(tokenizer):
    return StructuredOutputManager(lambda: tokenizer, 256, [EOS])


def request(request_id: str, constraint: StructuredOutputsParams | None) -> Request:
    params = SamplingParams(max_tokens=8, structured_outputs=constraint)
    return Request(request_id, [5, 6], params, eos_token_id=EOS)


def step(*requests: Request) -> SchedulerOutput:
    """A decode step of ``requests``, every one producing a token."""
    for r in requests:
        r.num_computed_tokens = r.num_tokens - 1
    return SchedulerOutput([ScheduledRequest(r, 1) for r in requests])


def allowed(bitmask: torch.Tensor, row: int) -> list[int]:
    logits = torch.zeros(bitmask.shape[0], 256)
    apply_grammar_bitmask(logits, bitmask)
    assert set(logits[row].tolist()) <= {0.0, float("-inf")}
    return (logits[row] == 0).nonzero().flatten().tolist()


def test_choice_mask_then_eos_then_finished(manager, tokenizer):
    constrained = request("c", StructuredOutputsParams(choice=["yes", "no"]))
    free = request("f", None)
    bitmask = manager.grammar_bitmask(step(free, constrained))
    assert bitmask is not None and bitmask.shape == (2, 8)
    assert allowed(bitmask, 0) == list(range(256))  # the free row
    first = sorted(tokenizer.encode(text, add_special_tokens=False)[0] for text in ("y", "n"))
    assert allowed(bitmask, 1) == first
    constrained.output_token_ids += tokenizer.encode("yes", add_special_tokens=False)
    assert manager.finished_requests([constrained]) == []
    assert allowed(manager.grammar_bitmask(step(constrained)), 0) == [EOS]
    constrained.output_token_ids.append(EOS)
    assert manager.finished_requests([constrained, free]) == [constrained]


def test_dropped_tokens_are_rolled_back(manager, tokenizer):
    constrained = request("c", StructuredOutputsParams(regex="ab|cd"))
    constrained.output_token_ids += tokenizer.encode("a", add_special_tokens=False)
    after_a = allowed(manager.grammar_bitmask(step(constrained)), 0)
    assert after_a == tokenizer.encode("b", add_special_tokens=False)
    del constrained.output_token_ids[:]  # the scheduler dropped the token
    first = sorted(tokenizer.encode(text, add_special_tokens=False)[0] for text in ("a", "c"))
    assert allowed(manager.grammar_bitmask(step(constrained)), 0) == first


def test_many_rows_are_filled_by_the_threaded_matcher_as_one_by_one(manager, tokenizer):
    """From ``BATCH_FILL_MIN_ROWS`` constrained rows xgrammar's batch filler takes over; its
    bitmask, free and finished rows between, equals the rows filled one at a time."""
    constraints = [StructuredOutputsParams(choice=["yes", "no"]),
                   StructuredOutputsParams(regex="ab|cd"),
                   StructuredOutputsParams(json={"type": "object"})]  # fmt: skip
    rows = [request(f"r{i}", constraints[i % 3]) for i in range(BATCH_FILL_MIN_ROWS + 2)]
    rows.insert(3, request("free", None))
    rows[5].output_token_ids += tokenizer.encode("a", add_special_tokens=False)  # mid-grammar
    batched = manager.grammar_bitmask(step(*rows))
    assert manager._batch_matcher is not None  # the batch filler ran
    one_by_one = StructuredOutputManager(lambda: tokenizer, 256, [EOS])
    every_token = torch.full((batched.shape[1],), -1, dtype=torch.int32)  # all bits set
    expected = torch.stack(
        [
            every_token
            if row.sampling_params.structured_outputs is None
            else one_by_one.grammar_bitmask(step(row))[0]
            for row in rows
        ]  # fmt: skip
    )
    assert torch.equal(batched, expected)
    assert allowed(batched, 3) == list(range(256))  # the free row
    assert rows[5].sampling_params.structured_outputs.regex == "ab|cd"
    assert allowed(batched, 5) == tokenizer.encode("b", add_special_tokens=False)  # after "a"


@pytest.mark.platform_agnostic  # on a GPU: pinned staging and xgrammar's Triton kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("staged", [False, True])
def test_masking_kernel_equals_the_torch_reference(dtype, staged):
    from pieceworks.platforms import current_platform

    device = current_platform().device(0)
    generator = torch.Generator().manual_seed(0)
    vocab = 1000  # 32 words of bits, the last only partly used
    bitmask = torch.randint(-(2**31), 2**31, (5, 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(5, vocab, generator=generator).to(device, dtype)
    expected = logits.clone()
    mask_logits_reference(expected, bitmask.to(device))
    # larger than the bitmask, as the runner's is
    staging = torch.full((8, 40), 7, dtype=torch.int32) if staged else None
    apply_grammar_bitmask(logits, bitmask, staging)
    assert torch.equal(logits, expected)
    masked = expected.isinf().sum().item()
    assert 0 < masked < expected.numel()  # about half the tokens of each row


def test_equal_constraints_compile_once(manager):
    first = manager.compile(StructuredOutputsParams(json={"type": "object"}))
    assert manager.compile(StructuredOutputsParams(json='{"type": "object"}')) is first
    assert manager.grammar_bitmask(step(request("f", None))) is None  # no constrained row


@pytest.mark.parametrize(
    "constraint, message",
    [
        (StructuredOutputsParams(regex="a(b"), "the regex does not compile: Regex parsing error"),
        (StructuredOutputsParams(json='{"type": "nope"}'), 'Unsupported type "nope"'),
        (StructuredOutputsParams(grammar="root ::= x"), 'Rule "x" is not defined'),
    ],
)
def test_a_bad_spec_is_refused_naming_it(manager, constraint, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_grammar(constraint)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        manager.compile(constraint)


def test_no_tokenizer_is_a_clear_error():
    manager = StructuredOutputManager(lambda: None, 256, [EOS])
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        manager.compile(StructuredOutputsParams(regex="a"))
