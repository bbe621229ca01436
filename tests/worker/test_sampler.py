"""The sampler picks the right tokens, and ``SamplingParams`` rejects bad values with a message.

Proves: greedy rows equal argmax, also mixed with random rows in one batch; top_k=1 equals greedy;
top-k and top-p never sample outside the kept set, and a nucleus whose mass reaches top_p exactly
keeps no token more; a seeded row yields the same tokens whatever its batch position or
neighbours, from a generator made on the logits' device; sampling frequencies follow
softmax(logits / temperature) within a tolerance, for every row of a batch that mixes seeded,
unseeded and greedy requests; the result is an int64 tensor on the logits' device, and sampling
runs on the meta device (where any host read of tensor data would raise), so the sampler makes no
host sync.

Run: pytest tests/worker/test_sampler.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.sampling_params import SamplingParams
from pieceworks.worker.sampler import (
    ARGMAX_CHUNK,
    Sampler,
    apply_top_k_top_p,
    make_generator,
    row_argmax,
)

DEVICE = torch.device("cpu")


def sample_rows(logits: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    """``num_draws`` independent draws from one row of logits, as one batch."""
    batch = logits.expand(num_draws, -1).contiguous()
    return Sampler().sample(batch, [params] * num_draws, [None] * num_draws)


def test_greedy_equals_argmax_and_mixes_with_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(8, 100, device=DEVICE)
    greedy = SamplingParams(temperature=0.0)
    token_ids = Sampler().sample(logits, [greedy] * 8, [None] * 8)
    assert torch.equal(token_ids, logits.argmax(dim=-1))
    mixed = [greedy, SamplingParams(temperature=1.5)] * 4
    token_ids = Sampler().sample(logits, mixed, [None] * 8)
    assert torch.equal(token_ids[::2], logits[::2].argmax(dim=-1))


@pytest.mark.parametrize("vocab_size", [7, 2 * ARGMAX_CHUNK + 1, 4 * ARGMAX_CHUNK, 128256])
def test_row_argmax_equals_torch_argmax_ties_included(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(5, vocab_size, generator=generator)
    logits[1] = -float("inf")  # a fully masked row: column 0, as torch
    logits[2, -1] = 100.0  # the max in the padded last chunk
    logits[3, [vocab_size // 2, vocab_size - 1, 3]] = 50.0  # a tie across chunks: the first
    logits[4] = logits[4].round()  # many ties inside each chunk
    torch.testing.assert_close(row_argmax(logits), logits.argmax(dim=-1), rtol=0, atol=0)


def test_top_k_one_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 50, device=DEVICE)
    params = [SamplingParams(temperature=2.0, top_k=1)] * 64
    for _ in range(5):
        assert torch.equal(Sampler().sample(logits, params, [None] * 64), logits.argmax(dim=-1))


def test_top_p_samples_only_the_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.1], device=DEVICE)
    # Sorted: 0.5, 0.3 reach 0.8 >= 0.7, so the nucleus is {1, 3} with weights 5/8 and 3/8.
    torch.manual_seed(2)
    token_ids = sample_rows(probs.log(), SamplingParams(top_p=0.7), num_draws=4000)
    assert set(token_ids.tolist()) == {1, 3}
    assert abs((token_ids == 1).float().mean().item() - 5 / 8) < 0.03


def test_top_k_samples_only_the_k_most_likely():
    probs = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.1], device=DEVICE)
    torch.manual_seed(3)
    token_ids = sample_rows(probs.log(), SamplingParams(top_k=3), num_draws=4000)
    assert set(token_ids.tolist()) == {1, 3, 4}


def test_apply_top_k_top_p_per_row_and_disabled_rows_keep_everything():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3, device=DEVICE)
    top_k = torch.tensor([2.0, 0.0, 0.0], device=DEVICE)  # row 0: k=2; rows 1-2: off
    top_p = torch.tensor([1.0, 1.0, 0.5], device=DEVICE)  # row 2: the top token holds 64%
    masked = apply_top_k_top_p(logits, top_k, top_p)
    kept = torch.isfinite(masked).tolist()
    assert kept == [[False, False, True, True], [True] * 4, [False, False, False, True]]


def test_top_p_nucleus_that_reaches_top_p_exactly_is_kept_alone():
    """Four equal logits: each probability is exactly 1/4, so top_p = n/4 is reached by exactly
    n tokens, and a token more would exceed the smallest set that reaches top_p."""
    logits = torch.zeros(4, 4, device=DEVICE)
    top_p = torch.tensor([0.25, 0.5, 0.75, 1.0], device=DEVICE)
    masked = apply_top_k_top_p(logits, None, top_p)
    assert torch.isfinite(masked).sum(dim=-1).tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_follow_softmax(temperature):
    logits = torch.tensor([0.0, 0.5, 1.0, 2.0], device=DEVICE)
    expected = (logits / temperature).softmax(dim=-1)
    torch.manual_seed(4)
    token_ids = sample_rows(logits, SamplingParams(temperature=temperature), num_draws=20_000)
    frequencies = torch.bincount(token_ids, minlength=4).float() / 20_000
    assert torch.allclose(frequencies, expected, atol=0.015), (frequencies, expected)


def test_every_row_of_a_mixed_seeded_batch_follows_its_distribution():
    """Seeded rows must not change how the unseeded rows of their batch sample (nor vice versa)."""
    logits = torch.tensor([0.0, 0.5, 1.0, 2.0], device=DEVICE)
    expected = logits.softmax(dim=-1)
    num_rows = 3000  # per kind: seeded, unseeded; plus greedy rows that must stay greedy
    params = (
        [SamplingParams(temperature=1.0, seed=seed) for seed in range(num_rows)]
        + [SamplingParams(temperature=1.0)] * num_rows
        + [SamplingParams(temperature=0.0)] * 8
    )
    generators = [make_generator(param, DEVICE) for param in params]
    torch.manual_seed(5)
    batch = logits.expand(len(params), -1).contiguous()
    token_ids = Sampler().sample(batch, params, generators)
    # A frequency of n draws has standard deviation sqrt(p (1 - p) / n) <= 0.0092 here; 5 of those
    # (0.046) fail a correct sampler with probability < 1e-5 per token, and the draws are seeded.
    # A row kind that stopped sampling puts all its mass on one token: off by >= 0.5.
    bound = 5 * (expected * (1 - expected) / num_rows).sqrt()
    for kind, rows in (("seeded", slice(0, num_rows)), ("unseeded", slice(num_rows, 2 * num_rows))):
        frequencies = torch.bincount(token_ids[rows], minlength=4).float() / num_rows
        assert ((frequencies - expected).abs() <= bound).all(), (kind, frequencies, expected)
    assert (token_ids[2 * num_rows :] == 3).all()  # greedy: the argmax


def seeded_run(row: int, batch_size: int, seed_params: SamplingParams, num_steps=8) -> list[int]:
    """Tokens a seeded request gets over ``num_steps`` at ``row`` of a batch of varied rows."""
    generator = make_generator(seed_params, DEVICE)
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=99),
        SamplingParams(temperature=1.0),
        SamplingParams(top_k=5, top_p=0.9),
    ]
    params = [neighbours[index % 4] for index in range(batch_size)]
    params[row] = seed_params
    generators = [make_generator(param, DEVICE) for param in params]
    generators[row] = generator
    token_ids = []
    for step in range(num_steps):
        logits = torch.randn(
            batch_size,
            32,
            device=DEVICE,
            generator=torch.Generator().manual_seed(step + 10 * batch_size),
        )
        logits[row] = torch.randn(32, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        token_ids.append(int(Sampler().sample(logits, params, generators)[row]))
    return token_ids


def test_same_seed_same_tokens_regardless_of_batch():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = seeded_run(row=0, batch_size=1, seed_params=params)
    assert seeded_run(row=3, batch_size=6, seed_params=params) == alone
    assert seeded_run(row=1, batch_size=9, seed_params=params) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert seeded_run(row=0, batch_size=1, seed_params=other_seed) != alone


def test_result_is_an_int64_device_tensor_and_needs_no_host_sync():
    params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5), SamplingParams(top_k=3)]
    logits = torch.randn(3, 10, device=DEVICE)
    token_ids = Sampler().sample(logits, params, [None] * 3)
    assert token_ids.device == logits.device and token_ids.dtype == torch.int64
    assert token_ids.shape == (3,)
    # Meta tensors have no data: .item(), .tolist() or a data-dependent branch would raise.
    on_meta = Sampler().sample(torch.empty(3, 10, device="meta"), params, [None] * 3)
    assert on_meta.is_meta and on_meta.shape == (3,)


def test_sampler_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="one SamplingParams and one generator per row"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()], [None])


def test_make_generator_only_for_seeded_random_requests():
    assert make_generator(SamplingParams(), DEVICE) is None
    assert make_generator(SamplingParams(temperature=0.0, seed=1), DEVICE) is None
    generator = make_generator(SamplingParams(seed=1), DEVICE)
    assert isinstance(generator, torch.Generator) and generator.initial_seed() == 1


def test_make_generator_creates_it_on_the_logits_device(monkeypatch):
    """A seeded row draws its noise on the device of the logits: a CPU generator cannot fill a
    CUDA tensor. Only CPU generators exist here, so the requested device is recorded."""
    devices, cpu_generator = [], torch.Generator

    def generator_on(device):
        devices.append(device)
        return cpu_generator()

    monkeypatch.setattr(torch, "Generator", generator_on)
    make_generator(SamplingParams(seed=3), "cuda:1")
    assert devices == ["cuda:1"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature=-0.1 must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k=-2 must be an integer >= 1, or 0 / -1"),
        ({"max_tokens": 0}, "max_tokens=0 must be an integer >= 1"),
        ({"seed": 1.5}, "seed=1.5 must be an integer or None"),
        ({"stop_token_ids": [3, -1]}, r"stop_token_ids must be non-negative integers; got \[-1\]"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    params = SamplingParams(stop_token_ids=[2, 3], top_k=-1)
    assert params.stop_token_ids == (2, 3) and not params.uses_top_k and not params.uses_top_p
    assert not params.is_greedy and SamplingParams(temperature=0.0).is_greedy
    hash(params)  # frozen and hashable: one instance can be shared by many requests
