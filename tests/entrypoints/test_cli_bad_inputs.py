"""Command-line inputs that used to end in a traceback: one ``error:`` line each.

Proves: a model directory whose ``tokenizer.json`` is garbage names the directory and the file;
an Inductor cache directory that cannot be written is refused before compiling, naming
``TORCHINDUCTOR_CACHE_DIR``; a prompt holding a lone surrogate (what Python makes of bytes in
``argv`` that are not UTF-8) names the prompt.
Run: pytest tests/entrypoints/test_cli_bad_inputs.py
"""

from __future__ import annotations

import shutil

from tests.engine.test_bad_inputs import tokenizer_dir
from tests.entrypoints.test_cli_errors import expect_error, generate, good_dir, model_dir

__all__ = ["good_dir", "model_dir", "tokenizer_dir"]  # fixtures


def test_a_garbage_tokenizer_json(capsys, model_dir):
    (model_dir / "tokenizer.json").write_text("\x00\x01 not a tokenizer")
    expect_error(
        capsys, generate(model_dir, "--token-ids", "1,2"), str(model_dir), "tokenizer.json",
        "do not load",
    )  # fmt: skip


def test_an_unwritable_inductor_cache_dir(capsys, good_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "inductor"))
    argv = [*generate(good_dir, "1,2"), "-O", "3"]
    expect_error(capsys, argv, "not writable", "TORCHINDUCTOR_CACHE_DIR")


def test_a_lone_surrogate_in_a_prompt(capsys, model_dir, tokenizer_dir):
    shutil.copytree(tokenizer_dir, model_dir, dirs_exist_ok=True)
    expect_error(capsys, generate(model_dir, "--no-chat", "ok\udcff"), "prompt 0", "surrogate")
