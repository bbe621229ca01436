"""``DecodeTail``: the work after the forward of a greedy decode step, captured as one graph.

After the FULL graph of a uniform decode step the runner would launch, one by one from Python,
the LM head, the two argmax kernels and, when another decode step of the same run follows, the
advance of the input buffers to that step (``multi_step.advance_rows``). For a small model
each of those launches costs the host about as long as the device needs for it, so the device
waits for the host (``docs/performance.md``, "Small models"). A ``DecodeTail`` is that work as
one callable, which the runner wraps in the platform's static-graph wrapper (FULL mode) and
captures once per decode capture size, after that size's FULL graph, reading the forward's
output at the address that graph writes it to. A decode step is then two graph launches.

Step ``step`` of a multi-step run has a tail of its own: it writes its ids to row ``step`` of
``InputBuffers.sampled_steps`` and advances the buffers with the slots ``StepInputs.prepare`` staged
for step ``step + 1``. The tail of the last possible step (``max_num_steps - 1``) does not advance;
a run of fewer steps advances once more after its last, which only writes buffers that the next
``prepare`` overwrites. Each tail's row and slots are fixed at capture, so a replay depends on no
state a failed run could leave behind.

The runner uses a tail only where its tokens are those of the launches it replaces
(``ModelRunner._uses_decode_tail``): every row greedy, no log-probabilities asked for, one
tensor-parallel rank (the sampled ids are then the same on every rank without a broadcast), and
as many requests as the capture size, so the LM head computes exactly the rows it would compute
outside the graph, with the same kernels.

A step whose batch holds a structured-output request runs the masked tail instead, one per
decode capture size: the tail of step 0 with, between the logits and the argmax, each row's
grammar bitmask applied from a static device buffer (``GraphCapture.grammar_bitmask``), which
the runner fills by one asynchronous copy once the engine has written the step's bitmask
(``GrammarMask.stage``). Free rows' bitmask rows allow every token, so their ids are the
unmasked tail's; constrained rows get the argmax over the tokens their grammar allows, as the
host sampler gives them (``apply_grammar_bitmask`` then ``row_argmax``).
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.worker.input_buffers import InputBuffers
from pieceworks.worker.multi_step import advance_rows
from pieceworks.worker.sampler import row_argmax
from pieceworks.worker.structured_output import mask_logits_reference


class DecodeTail:
    """Logits of every row of a decode step, masked by ``bitmask``'s first rows where given (a
    static ``(max_num_seqs, ceil(V / 32))`` int32 device buffer), their argmax into
    ``sampled_steps`` row ``step``, then (``advance``) the buffers moved on to step ``step + 1``.
    Called with the step's hidden states ``(S, hidden)``; returns the sampled ids ``(S,)``."""

    def __init__(
        self,
        model: Any,
        buffers: InputBuffers,
        step: int,
        advance: bool,
        bitmask: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.step = step
        self.advance = advance
        self.bitmask = bitmask

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_seqs = hidden_states.shape[0]
        logits = self.model.compute_logits(hidden_states)  # (S, V)
        if self.bitmask is not None:
            mask_logits_reference(logits, self.bitmask[:num_seqs])
        token_ids = row_argmax(logits)  # (S,)
        first = self.step * num_seqs
        self.buffers.sampled_steps[first : first + num_seqs].copy_(token_ids)
        if self.advance:
            advance_rows(self.buffers, token_ids, self.step + 1)
        return token_ids
