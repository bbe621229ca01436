"""The gated delta rule (Gated DeltaNet's recurrence): its torch forms, chunked for prefill and
recurrent for decode (``torch_gated_delta_rule.py``), the oracle of any kernel and the CPU
implementation. flash-linear-attention's Triton kernels are the intended GPU forms
(``docs/kernels.md``, "Gated delta rule")."""
