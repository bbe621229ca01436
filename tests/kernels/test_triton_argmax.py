"""The greedy argmax kernel returns ``torch.argmax``'s index for every row, bit for bit.

Proves, for float32, bfloat16 and float16 logits: ties go to the first index within a block and
across blocks (a row walked in several blocks, the last one partial), a row of -inf gives column
0, any NaN wins (the first NaN, as torch), -0.0 and +0.0 tie, negative values order by magnitude;
rows read through a row stride (the tensor-parallel gather's column slice); the vocabulary of the
8B model in one block walk; and that the sampler takes the kernel for greedy rows wherever
``uses_kernel`` says so and returns the same ids as its torch form. On CPU the kernel runs under
the Triton interpreter; on a GPU compiled.

Run: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_triton_argmax.py -p no:cacheprovider
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.kernels.sampling import triton_argmax
from pieceworks.sampling_params import SamplingParams
from pieceworks.worker import sampler as sampler_module
from pieceworks.worker.sampler import Sampler, chunked_argmax
from tests.kernels.test_triton_gemv import DEVICE, ON_GPU, requires_triton

pytestmark = requires_triton
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tricky_rows(vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that exercise every ordering rule, in ``dtype``."""
    generator = torch.Generator().manual_seed(vocab_size)
    rows = torch.randn(8, vocab_size, generator=generator)
    rows[1] = -float("inf")  # all masked: column 0
    rows[2, [3, vocab_size // 2, vocab_size - 1]] = 50.0  # a tie across blocks: the first
    rows[3] = rows[3].round()  # many ties inside each block
    rows[4, vocab_size - 1] = 100.0  # the max in the partial last block
    rows[5] = -rows[5].abs() - 1.0  # all negative: the one nearest zero
    rows[6] = 0.0  # -0.0 before +0.0 ties with it: the first
    rows[6, 1] = -0.0
    rows[6, 2:] = -1.0
    rows[7, [vocab_size - 2, 5]] = float("nan")  # NaN wins; the first one
    rows[7, 0] = float("inf")
    return rows.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block,vocab_size", [(64, 7), (64, 200), (64, 256), (1024, 5000)])
def test_kernel_equals_torch_argmax(monkeypatch, dtype, block, vocab_size):
    monkeypatch.setattr(triton_argmax, "ARGMAX_BLOCK", block)  # several blocks per row
    logits = tricky_rows(vocab_size, dtype)
    expected = logits.float().cpu().argmax(dim=-1)
    assert expected[6] == 0 and expected[7] == 5  # the cases are what they claim to be
    assert torch.equal(triton_argmax.launch_row_argmax(logits).cpu(), expected)


def test_kernel_reads_rows_through_their_stride():
    padded = tricky_rows(300, torch.bfloat16)
    logits = padded[:, :257]  # a column slice: rows 300 apart, the last block partial
    expected = logits.float().cpu().argmax(dim=-1)
    assert torch.equal(triton_argmax.launch_row_argmax(logits).cpu(), expected)


def test_kernel_at_the_8b_vocabulary():
    logits = tricky_rows(128256, torch.bfloat16)[:3]
    expected = logits.float().cpu().argmax(dim=-1)
    assert torch.equal(triton_argmax.launch_row_argmax(logits).cpu(), expected)


def test_kernel_rejects_columns_that_are_not_contiguous():
    logits = torch.zeros(4, 6, device=DEVICE).t()
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_argmax.launch_row_argmax(logits)
    assert not triton_argmax.uses_kernel(logits)


def test_sampler_takes_the_kernel_where_it_runs(monkeypatch):
    logits = tricky_rows(3000, torch.bfloat16)
    launched = []
    launch = triton_argmax.launch_row_argmax
    monkeypatch.setattr(
        triton_argmax, "launch_row_argmax", lambda x: launched.append(x) or launch(x)
    )
    if not ON_GPU:  # the CPU platform runs no Triton kernels: pretend it does, for this test
        monkeypatch.setattr(triton_argmax, "uses_kernel", lambda x: True)
    greedy = [SamplingParams(temperature=0.0)] * logits.shape[0]
    token_ids = Sampler().sample(logits, greedy, [None] * len(greedy))
    assert len(launched) == 1 and launched[0] is logits  # no float32 copy first
    assert torch.equal(token_ids.cpu(), chunked_argmax(logits.float()).cpu())
    assert token_ids.dtype == torch.int64 and token_ids.device == logits.device
    monkeypatch.setattr(triton_argmax, "uses_kernel", lambda x: False)
    assert torch.equal(sampler_module.row_argmax(logits).cpu(), token_ids.cpu())
