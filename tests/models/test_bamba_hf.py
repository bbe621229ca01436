"""Bamba logits equal HF transformers' ``BambaForCausalLM`` on the same saved checkpoint (float32).

A small hybrid (Mamba2 layers around one attention layer, two SSM groups) with randomised
``A_log``, ``D``, ``dt_bias`` and gated-norm weights (their usual init of ones would hide bugs).
Driven step by step through the engine: prefills, prefill + decode steps, a chunked prefill whose
chunks (22, 22, 2 tokens) are aligned with neither the scan chunk nor ``d_conv``, and mixed steps
(that prefill alongside two decodes); compile levels 0 and 3, and the Triton Mamba backend under
the Triton interpreter. Tolerance (SPEC §4): max |diff| <= 1e-4 * max |HF logit|. The reference's
gated norms normalize each SSM group apart on every transformers
(``normalize_gated_norms_per_group``).
Run: pytest tests/models/test_bamba_hf.py
"""

from __future__ import annotations

import functools
import inspect
import types

import pytest
import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.hf_directory import save_hf_directory
from pieceworks.models.loading.presets import get_preset, random_hf_weights
from pieceworks.platforms import current_platform
from pieceworks.sampling_params import SamplingParams
from tests.models.test_llama_hf import assert_close_to_hf, hf_last_logits

transformers = pytest.importorskip("transformers")

HF_CONFIG = {**get_preset("bamba-tiny"), "mamba_n_groups": 2, "torch_dtype": "float32"}


def randomised_weights(hf_config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The preset's random weights, with the SSM parameters and gated norms drawn at random too."""
    generator = torch.Generator().manual_seed(seed + 1)
    state_dict = dict(random_hf_weights(hf_config, seed=seed))
    for name, tensor in state_dict.items():
        noise = torch.randn(tensor.shape, generator=generator)
        if name.endswith(".A_log"):  # A = -exp(A_log) in [-8, -0.5)
            state_dict[name] = torch.empty(tensor.shape).uniform_(-0.7, 2.0, generator=generator)
        elif name.endswith((".D", ".dt_bias")):
            state_dict[name] = noise
        elif name.endswith(".mamba.norm.weight"):
            state_dict[name] = 1.0 + 0.5 * noise
    return state_dict


def per_group_gated_norm(norm, hidden_states, gate=None, *, num_groups: int):
    """transformers 5.23's ``BambaRMSNormGated.forward``: x * silu(gate), each of the
    ``num_groups`` groups of the last dim normalized by its own RMS, times the weight."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    if gate is not None:
        hidden_states = hidden_states * torch.nn.functional.silu(gate.to(torch.float32))
    grouped = hidden_states.unflatten(-1, (num_groups, -1))
    variance = grouped.pow(2).mean(-1, keepdim=True)
    hidden_states = (grouped * torch.rsqrt(variance + norm.variance_epsilon)).flatten(-2)
    return norm.weight * hidden_states.to(input_dtype)


def hf_norms_per_group() -> bool:
    from transformers.models.bamba import modeling_bamba

    return "group_size" in inspect.signature(modeling_bamba.BambaRMSNormGated.__init__).parameters


def normalize_gated_norms_per_group(hf_model, num_groups: int) -> int:
    """Give HF's gated norms the per-group normalization of transformers >= 5.23; returns how
    many norms were changed (0 where HF already normalizes per group).

    Mamba2's gated RMSNorm normalizes each of the ``n_groups`` groups of the intermediate size by
    its own RMS (mamba_ssm's ``RMSNormGated(group_size=d_ssm // ngroups)``, and pieceworks).
    ``BambaRMSNormGated`` before transformers 5.23 normalizes over the whole intermediate size,
    which is the same only for one group: with two, its logits are 1e-2 of the scale off the
    per-group ones. On those versions the reference gets 5.23's forward, so the two-group
    checkpoint is checked against the right numbers on every transformers this test meets."""
    if hf_norms_per_group():
        return 0
    from transformers.models.bamba import modeling_bamba

    forward = functools.partial(per_group_gated_norm, num_groups=num_groups)
    norms = [m for m in hf_model.modules() if isinstance(m, modeling_bamba.BambaRMSNormGated)]
    for norm in norms:
        norm.forward = types.MethodType(forward, norm)
    return len(norms)


def make_hf_model(path) -> tuple[str, object]:
    """Save the randomised checkpoint under ``path``; return it and HF's model of it (CPU), its
    gated norms normalizing per group (``normalize_gated_norms_per_group``)."""
    save_hf_directory(randomised_weights(HF_CONFIG, seed=1), HF_CONFIG, path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    normalize_gated_norms_per_group(hf_model, HF_CONFIG["mamba_n_groups"])
    return str(path), hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("bamba"))


def run_and_compare(
    llm: LLM, hf_model, prompts, steps: int, late_prompts=(), tolerance: float = 1e-4
) -> int:
    """Drive the engine step by step; compare every produced logit row with HF's."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    compared, pending, chunks = 0, list(late_prompts), []
    while engine.has_unfinished_requests():
        output = engine.scheduler.schedule()
        chunks += [s.num_new_tokens for s in output.scheduled_requests if not s.produces_token]
        logits = engine.runner.compute_logits(output)
        producing = [s.request for s in output.scheduled_requests if s.produces_token]
        for row, request in enumerate(producing):
            reference = hf_last_logits(hf_model, request.all_token_ids)
            assert_close_to_hf(logits[row].cpu(), reference, tolerance)
            compared += 1
        sampled = logits.argmax(dim=-1).tolist() if logits is not None else []
        engine.scheduler.update_from_output(output, sampled)
        if pending:  # a new prompt arrives while the others decode: the next steps are mixed
            engine.add_request(pending.pop(), params)
    assert chunks == [22, 22]  # the late prompt was cut, unaligned, before its last 2 tokens
    return compared


def make_llm(path: str, level: int) -> LLM:
    return LLM(
        path,
        compilation_config={"level": level, "backend": "eager"},
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=24,
    )


def prompt_maker(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(0, 256, (n,), generator=generator).tolist()


@pytest.mark.parametrize("level", [0, 3])
def test_prefill_decode_chunked_and_mixed_batches_match_hf(saved, level):
    path, hf_model = saved
    prompt = prompt_maker(level)
    # Prompts of 5 and 11 tokens prefill together, then decode; a 46-token prompt arrives after
    # the first step and is chunked 22 + 22 + 2 by the 24-token budget beside two decodes.
    compared = run_and_compare(
        make_llm(path, level), hf_model, [prompt(5), prompt(11)], steps=4, late_prompts=[prompt(46)]
    )
    assert compared == 3 * 4  # every produced token of every request was checked


def test_triton_backend_matches_hf(saved, monkeypatch):
    """The Triton kernels (interpreted on CPU) behind the same decode / prefill split."""
    if not current_platform().supports_static_graphs():  # a CPU run: interpret the kernels
        monkeypatch.setattr(
            type(current_platform()),
            "mamba_backend_qualname",
            "pieceworks.models.mamba.backends.TritonMambaBackend",
        )
    path, hf_model = saved
    llm = make_llm(path, 0)
    assert llm.engine.runner.model.model.layers[0].mamba.backend.name == "triton"
    prompt = prompt_maker(7)
    compared = run_and_compare(llm, hf_model, [prompt(5), prompt(11)], 4, [prompt(46)])
    assert compared == 3 * 4


def test_the_kernels_a_gpu_chooses_match_hf(saved, monkeypatch):
    """Every kernel choice an H200 makes (Triton attention, Mamba, GEMV, activation and argmax,
    the GEMV with the H200's tile file, shared memory and SM count), run by Triton's interpreter
    on CPU tensors: HF's logits within 1e-4 of the scale, so on a GPU a gap to HF is the launch
    or the hardware's arithmetic, not what the kernels compute."""
    from pieceworks.kernels import triton_device
    from pieceworks.kernels.gemv import triton_gemv, triton_gemv_config
    from pieceworks.platforms.capability import TRITON, DeviceCapability

    if current_platform().supports_static_graphs():
        pytest.skip("on a GPU the kernels run compiled: tests/models/test_bamba_gpu.py")
    platform = type(current_platform())
    backends = "pieceworks.models.{0}.backends.Triton{1}Backend"
    monkeypatch.setattr(
        platform, "attention_backend_qualname", backends.format("attention", "Attention")
    )
    monkeypatch.setattr(platform, "mamba_backend_qualname", backends.format("mamba", "Mamba"))
    capability = DeviceCapability(vendor="cpu", features=frozenset({TRITON}))
    monkeypatch.setattr(platform, "device_capability", classmethod(lambda cls: capability))
    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    monkeypatch.setattr(triton_gemv_config, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(triton_gemv_config, "max_shared_bytes", lambda device: 232448)
    monkeypatch.setattr(triton_gemv_config, "num_sms", lambda device: 132)
    launches = []
    launch_gemv = triton_gemv.launch_gemv
    monkeypatch.setattr(
        triton_gemv,
        "launch_gemv",
        lambda *args, **kw: launches.append(1) or launch_gemv(*args, **kw),
    )
    path, hf_model = saved
    llm = make_llm(path, 0)
    chosen = llm.engine.runner.kernels.chosen_kernels()
    choices = {op: choice.impl.name for op, choice in chosen.items()}
    assert choices["linear"] == "triton_gemv" and choices["silu_and_mul"] == "triton_silu_and_mul"
    assert llm.engine.runner.model.model.layers[0].mamba.backend.name == "triton"
    prompt = prompt_maker(11)
    compared = run_and_compare(llm, hf_model, [prompt(5), prompt(11)], 4, [prompt(46)])
    assert compared == 3 * 4
    assert launches  # the GEMV ran (every step of at most 16 tokens)


def test_hf_really_rotates_half_of_each_head(saved):
    path, hf_model = saved
    head_dim = HF_CONFIG["hidden_size"] // HF_CONFIG["num_attention_heads"]
    assert 2 * hf_model.model.rotary_emb.inv_freq.numel() == head_dim // 2
    llm = make_llm(path, 0)
    attention = llm.engine.runner.model.model.layers[HF_CONFIG["attn_layer_indices"][0]]
    assert attention.self_attn.rotary_emb.rotary_dim == head_dim // 2


def test_the_reference_gated_norm_normalizes_each_group(saved):
    """The reference's gated norms normalize per group: HF's own (transformers >= 5.23) or the
    forward given to older versions, which equals 5.23's; scaling one group's input leaves the
    other group's output unchanged, which a norm over the whole width does not."""
    _, hf_model = saved
    norm = hf_model.model.layers[0].mamba.norm
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 128, generator=generator)
    gate = torch.randn(2, 3, 128, generator=generator)
    scaled = x.clone()
    scaled[..., :64] *= 10.0
    out, out_scaled = norm(x, gate), norm(scaled, gate)
    torch.testing.assert_close(out_scaled[..., 64:], out[..., 64:], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out_scaled[..., :64], out[..., :64])
    if hf_norms_per_group():  # HF's own forward is the one the older versions are given
        expected = per_group_gated_norm(norm, x, gate, num_groups=HF_CONFIG["mamba_n_groups"])
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
