"""The persistent ring FP8 GEMV's host side, on the CPU (``models/layers/ring_gemv.py``).

Gluon kernels do not run under Triton's interpreter: the kernel is checked by the GPU tests
(``test_ring_gemv_gpu.py``) and compiled for sm_90 by ``test_kernels_compile.py``. Here: the
copy-group count every step waits with, against a simulation of the kernel's commit order over
several tiles (too small a count reads a chunk still in flight, too large one waits for copies it
does not need); that no copy lands in a slot an MMA may still read; and how many slots fit.
Run: PYTHONPATH=. python -m pytest tests/models/test_ring_gemv.py -q
"""

from __future__ import annotations

import pytest

from pieceworks.models.layers.ring_gemv import ring_slots, ring_wait_groups


def simulate(total_steps: int, slots: int):
    """Walk the kernel's steps; yield (step, copy groups committed before its wait, the step
    each slot holds), groups as sets of ("w" or "x", step), oldest first. x of the first
    ``slots`` steps is stored with plain loads after the wait, in no group."""
    groups = [{("w", step)} for step in range(slots)]
    held = list(range(slots))
    for step in range(total_steps):
        yield step, list(groups), list(held)
        if step >= 1:  # after MMA step retires step - 1's: its slot takes step - 1 + slots
            refill = step - 1 + slots
            assert refill % slots != step % slots  # never the slot MMA step may still read
            held[refill % slots] = refill
            groups.append({("w", refill), ("x", refill)})


@pytest.mark.parametrize("slots", [2, 3, 7, 12])
@pytest.mark.parametrize("total_steps", [2, 5, 16, 56, 3 * 16])
def test_each_step_waits_for_the_copies_it_reads_and_no_more(total_steps, slots):
    if slots > total_steps:
        return
    for step, groups, held in simulate(total_steps, slots):
        assert held[step % slots] == step, (step, held)  # the MMA reads its own step's chunks
        needed = max(i for i, group in enumerate(groups) if {("w", step), ("x", step)} & group)
        newer = len(groups) - 1 - needed
        count = ring_wait_groups(slots)
        if step == 0:
            assert count == newer - 1  # W of step 1 too: one group more than needed
        else:
            assert count == newer, (step, count, newer)


def test_ring_slots_at_the_8b_shapes():
    sm90_shared = 232448
    assert ring_slots(1, sm90_shared, gated=False, num_chunks=56) == 12  # 12 x (16 + 2) KB
    assert ring_slots(1, sm90_shared, gated=True, num_chunks=16) == 12  # and a 2 KB scratch
    assert ring_slots(16, sm90_shared, gated=True, num_chunks=16) == 11  # 20 KB slots
    assert ring_slots(1, sm90_shared, gated=False, num_chunks=2) == 2  # at most a tile's steps
    assert ring_slots(1, 40000, gated=False, num_chunks=16) == 2
