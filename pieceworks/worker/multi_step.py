"""Multi-step decode: the later steps' slots staged by the host, and the advance on the device.

A multi-step output (``SchedulerOutput.num_steps`` > 1, a uniform decode batch) runs the same
graph ``num_steps`` times. When ``StepInputs.prepare`` lays out its first step it also stages the
slot of every later step (``stage_step_slots``: step 1's for every sequence, then step 2's, ...;
their blocks are reserved ahead), copied to the device with the rest. Between two steps
``advance_decode`` then moves the device buffers on by one step with four small device ops and no
block-table lookup: the sampled ids become the input ids, positions and sequence lengths grow by
one, and the slots are the ones staged for that step. Padded rows stay inert; the staging buffers
are untouched (the next ``prepare`` writes every field it copies from them).

The runner calls ``advance_decode`` between launches; a captured decode tail
(``worker/decode_tail.py``) records ``advance_rows``, the device ops alone.
"""

from __future__ import annotations

import numpy as np
import torch

from pieceworks.worker.input_buffers import InputBuffers


def stage_step_slots(
    buffers: InputBuffers, computed: np.ndarray, num_seqs: int, block_size: int, num_steps: int
) -> int:
    """Write the slots of steps 1 .. num_steps - 1 of a decode batch (position computed + step)
    into the current staging buffer, step-major; how many: (num_steps - 1) * num_seqs."""
    num_step_slots = (num_steps - 1) * num_seqs
    if num_steps == 1:
        return 0
    host = buffers.host
    positions = computed + np.arange(1, num_steps)[:, None]  # (K - 1, S)
    blocks = host["block_tables"][np.arange(num_seqs), positions // block_size]
    slots = blocks.astype(np.int64) * block_size + positions % block_size
    host["step_slots"][:num_step_slots] = slots.ravel()
    return num_step_slots


def advance_decode(
    buffers: InputBuffers, sampled: torch.Tensor, step: int, num_step_slots: int
) -> None:
    """Turn the device buffers of a multi-step decode output into its step ``step`` (>= 1): input
    ids become ``sampled`` (S,), the previous step's ids, positions and sequence lengths grow by
    one, and the slots are the ones staged for that step (``num_step_slots`` of them)."""
    num_seqs = sampled.shape[0]
    if not 1 <= step <= num_step_slots // max(num_seqs, 1):
        raise ValueError(
            f"step {step} of a run of {num_seqs} sequences: prepare() staged slots for "
            f"{num_step_slots // max(num_seqs, 1)} later steps; pass num_steps to it"
        )
    advance_rows(buffers, sampled, step)


def advance_rows(buffers: InputBuffers, sampled: torch.Tensor, step: int) -> None:
    """``advance_decode`` without its check against what was staged: the device ops alone, as a
    captured decode tail records them (its capture runs on a dummy step)."""
    num_seqs = sampled.shape[0]
    buffers["input_ids"][:num_seqs].copy_(sampled)
    buffers["positions"][:num_seqs].add_(1)
    buffers["seq_lens"][:num_seqs].add_(1)
    first = (step - 1) * num_seqs
    buffers["slot_mapping"][:num_seqs].copy_(buffers["step_slots"][first : first + num_seqs])
