"""Every error a user can cause on the command line is one ``error:`` line, without a traceback.

``pieceworks.entrypoints.cli.main`` is called on bad checkpoint directories (only a PyTorch
pickle, no weights, a missing shard, empty, truncated or garbage safetensors, config.json that
does not parse or lacks a size, an unimplemented activation), bad ``--compilation-config`` values,
``--max-model-len 0``, bad prompts and sampling values (refused before the model is built) and a
``--tensor-parallel-size`` the heads cannot be split over (refused before any rank starts), a GGUF
file that does not parse, and the errors that were clear already (limits, unknown model). Each
gives exit status 2 and one line naming the file, field or flag; ``--debug`` raises instead; the
same command on a good directory still answers.
Run: pytest tests/entrypoints/test_cli_errors.py
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pieceworks.entrypoints.cli import main
from pieceworks.models.loading.hf_directory import save_hf_directory
from pieceworks.models.loading.presets import get_preset, random_hf_weights

HF_CONFIG = {**get_preset("llama-tiny"), "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    save_hf_directory(
        dict(random_hf_weights(HF_CONFIG, seed=0, dtype=torch.float32)), HF_CONFIG, path
    )
    return path


@pytest.fixture
def model_dir(good_dir, tmp_path):
    """A fresh copy of the good checkpoint, for a test to damage."""
    return shutil.copytree(good_dir, tmp_path / "model")


def generate(model, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "-O", "0", "--max-tokens", "2", *extra]


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    """Exit status and the one error line (asserting there is exactly one, and no traceback)."""
    status = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return status, errors[0]


def expect_error(capsys, argv: list[str], *fragments: str) -> None:
    status, line = run_cli(capsys, argv)
    assert status == 2
    for fragment in fragments:
        assert fragment in line, line


def test_a_good_directory_answers(capsys, good_dir):
    assert main(generate(good_dir, "1,2,3", "4,5")) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("(length)" in line for line in out)


def test_only_a_pytorch_pickle(capsys, model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    expect_error(
        capsys, generate(model_dir, "1,2"), "no *.safetensors", "found pytorch_model.bin",
        "safe_serialization=True",
    )  # fmt: skip


def test_no_weights(capsys, model_dir):
    (model_dir / "model.safetensors").unlink()
    expect_error(capsys, generate(model_dir, "1,2"), f"{model_dir} has no *.safetensors weights")


def test_a_missing_shard(capsys, tmp_path):
    weights = dict(random_hf_weights(HF_CONFIG, seed=0, dtype=torch.float32))
    save_hf_directory(weights, HF_CONFIG, tmp_path, max_shard_bytes=100_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    expect_error(
        capsys, generate(tmp_path, "1,2"), "lists shards that do not exist", shards[-1].name
    )


def test_an_empty_directory(capsys, tmp_path):
    expect_error(capsys, generate(tmp_path, "1,2"), f"{tmp_path}/config.json not found")


def test_a_missing_directory(capsys, tmp_path):
    expect_error(capsys, generate(tmp_path / "nope", "1,2"), "is neither a preset")


def test_truncated_safetensors(capsys, model_dir):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    expect_error(capsys, generate(model_dir, "1,2"), f"{path} is not a readable safetensors file")


def test_garbage_safetensors(capsys, model_dir):
    path = model_dir / "model.safetensors"
    path.write_bytes(b"\xff" * 64)
    expect_error(capsys, generate(model_dir, "1,2"), f"{path} is not a readable safetensors file")


def test_config_json_that_does_not_parse(capsys, model_dir):
    (model_dir / "config.json").write_text('{"hidden_size": 64, "vocab_size": }')
    expect_error(
        capsys, generate(model_dir, "1,2"), f"{model_dir}/config.json is not valid JSON",
        "line 1 column 35",
    )  # fmt: skip


def test_config_json_without_hidden_size(capsys, model_dir):
    hf_config = {k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    expect_error(capsys, generate(model_dir, "1,2"), "config.json lacks 'hidden_size'")


def test_an_unimplemented_activation(capsys, model_dir):
    (model_dir / "config.json").write_text(json.dumps({**HF_CONFIG, "hidden_act": "gelu"}))
    expect_error(capsys, generate(model_dir, "1,2"), "hidden_act='gelu' is not supported")


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        ('{"cudagraph_mode": "SOMETIMES"}', ["cudagraph_mode='SOMETIMES'", "FULL_AND_PIECEWISE"]),
        ("[1,2]", ["'[1,2]' is a JSON list, not an object"]),
        ("3", ["'3' is a JSON int, not an object"]),
        ("{level: 3}", ["is not valid JSON"]),
        ('{"foo": 1}', ["unknown CompilationConfig field(s) 'foo'", "valid fields: level,"]),
        ('{"level": 7}', ["level=7 is not valid", "3 (PIECEWISE)"]),
    ],
)
def test_bad_compilation_config(capsys, value, fragments):
    argv = ["generate", "--model", "llama-tiny", "--compilation-config", value, "1,2"]
    expect_error(capsys, argv, *fragments)


def test_max_model_len_zero(capsys):
    argv = ["generate", "--model", "llama-tiny", "-O", "0", "--max-model-len", "0", "1,2"]
    expect_error(capsys, argv, "max_model_len=0 must be a positive integer")


@pytest.fixture
def no_model_build(monkeypatch):
    """Building an LLM fails the test: the error must come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the error was found")

    monkeypatch.setattr("pieceworks.engine.llm.LLM.__init__", refuse)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--temperature", "-1", "1,2"], "temperature=-1.0 must be a finite number >= 0"),
        (["--top-p", "0", "1,2"], "top_p=0.0 must be in (0, 1]"),
        (["--max-tokens", "0", "1,2"], "max_tokens=0 must be an integer >= 1"),
        ([""], "prompt 0 is empty"),
        (["1,2", "3,x"], "prompt 1 '3,x' is not comma-separated token ids"),
        ([" "], "prompt 0 is empty"),
        (["hello"], "prompt 0 'hello' is not comma-separated token ids"),
    ],
)
def test_bad_prompts_and_sampling_values_before_the_build(capsys, no_model_build, extra, fragment):
    expect_error(capsys, ["generate", "--model", "llama-tiny", *extra], fragment)


def test_a_sampling_flag_typo_is_refused_by_the_parser(capsys, no_model_build):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "llama-tiny", "--temprature", "0.5", "1,2"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --temprature" in capsys.readouterr().err


def test_tensor_parallel_size_that_cannot_split_the_heads(capsys, monkeypatch):
    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr("pieceworks.worker.executor.MultiprocExecutor.__init__", no_ranks)
    argv = ["generate", "--model", "llama-tiny", "--tensor-parallel-size", "3", "1,2"]
    expect_error(capsys, argv, "num_attention_heads=4 is not divisible by tensor_parallel_size=3")


@pytest.mark.parametrize("position", ["first", "last"])
def test_debug_shows_the_traceback(capsys, position):
    argv = ["generate", "--model", "llama-tiny", "--max-model-len", "0", "-O", "0", "1,2"]
    argv = ["--debug", *argv] if position == "first" else [*argv, "--debug"]
    with pytest.raises(ValueError, match="max_model_len=0"):
        main(argv)


@pytest.mark.parametrize(
    "content", [b"garbage", b"GGUF\x03\x00\x00\x00" + b"\xff" * 40], ids=["garbage", "truncated"]
)
def test_a_gguf_file_that_does_not_parse(capsys, tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    expect_error(capsys, generate(path, "1,2"), f"{path} is not a readable GGUF file")


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--max-model-len", "100000"], ["max_model_len=100000 exceeds", "=2048"]),
        (["--block-size", "3"], ["block_size=3 must be a power of two"]),
        (["--gpu-memory-utilization", "2"], ["gpu_memory_utilization=2.0 must be in (0, 1]"]),
        (["--max-num-batched-tokens", "1"], ["max_num_batched_tokens=1 is below max_num_seqs"]),
        (
            ["--max-model-len", "8", "--max-tokens", "4", "1,2,3,4,5,6,7"],
            ["exceeds max_model_len=8"],
        ),
        (["1,2,999"], ["prompt 0: token id 999 at position 2 is outside"]),
    ],
)
def test_errors_that_were_already_clear_stay_one_line(capsys, extra, fragments):
    prompt = [] if any("," in arg or arg == "hello" for arg in extra) else ["1,2"]
    expect_error(
        capsys, ["generate", "--model", "llama-tiny", "-O", "0", *extra, *prompt], *fragments
    )


def test_unknown_model_names_lists_the_presets(capsys):
    expect_error(capsys, ["generate", "--model", "no-such-model", "1,2"], "llama-tiny", "*.gguf")


def test_fp8_on_an_architecture_without_it(capsys):
    argv = ["generate", "--model", "bamba-tiny", "-O", "0", "--quantization", "fp8", "1,2"]
    expect_error(capsys, argv, "quantization='fp8' is implemented for LlamaForCausalLM")
