"""``pieceworks bench serve --plot`` without matplotlib: one ``error:`` line before the run.

Proves: the missing package is named with the command that installs it, and nothing is sent
(no server is needed: the check comes before the first request).
Run: ``pytest tests/entrypoints/test_bench_plot.py -q``.
"""

from __future__ import annotations

import sys

from tests.entrypoints.test_cli_errors import expect_error


def test_plot_without_matplotlib_is_refused_before_the_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", str(tmp_path / "p.png")]
    expect_error(capsys, argv, "--plot needs matplotlib", "pip install matplotlib")
