"""The gated delta rule (Gated DeltaNet's recurrence): its torch forms, chunked for prefill and
recurrent for decode (``torch_gated_delta_rule.py``, the oracle); the two ops over state slots
the Gated DeltaNet layer calls, in torch (``torch_state_slots.py``) and with
flash-linear-attention's Triton kernels (``fla_gated_delta_rule.py``); their registry entries
(``registration.py``, ``docs/kernels.md``, "Gated delta rule")."""
