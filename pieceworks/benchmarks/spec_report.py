"""The speculative-decoding table: output tokens per second with and without speculation.

``bench latency`` rows carry their prompt kind, their output tokens per second and, under
speculative decoding, the acceptance of that kind's runs (``latency.py``). A speculative run and
the run without speculation of the same model, dtype, batch, mode, prompt kind, device and commit
(separate ``bench latency`` runs: speculation is an engine argument) are paired here, and the
speed-up is their ratio of output tokens per second. ``benchmarks/perf_table.py`` prints this
table under the main one when any of its files has a speculative row.
"""

from __future__ import annotations

from typing import Any

SPECULATIVE_COLUMNS = [
    "model", "dtype", "batch", "mode", "prompt kind", "speculation", "output tokens/s",
    "x without speculation", "acceptance", "mean accepted length", "device", "commit",
]  # fmt: skip


def _rows(payloads: list[dict[str, Any]]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(pairing key, row) for every measured pieceworks row with an output rate."""
    rows = []
    for payload in payloads:
        for r in payload["results"]:
            if r.get("status", "ok") != "ok" or r.get("graph_mode") == "baseline":
                continue
            if r.get("output_tokens_per_s") is None:
                continue
            key = (
                payload["model"], payload.get("dtype", "?"), r["batch_size"], r["mode"],
                r.get("prompt_kind", "random"), payload.get("device"), payload.get("commit"),
            )  # fmt: skip
            rows.append((key, r))
    return rows


def format_speculative_table(payloads: list[dict[str, Any]]) -> str:
    """A markdown table of the speculative rows, each beside its run without speculation;
    empty when no row ran speculative decoding."""
    rows = _rows(payloads)
    plain = {key: r for key, r in rows if not r.get("speculative")}
    lines = []
    for key, r in rows:
        spec = r.get("speculative")
        if not spec:
            continue
        model, dtype, batch, mode, kind, device, commit = key
        base = plain.get(key)
        ratio = f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}" if base else "-"
        cells = [
            model, dtype, str(batch), mode, kind,
            f"{spec['method']} k={spec['num_speculative_tokens']}",
            f"{r['output_tokens_per_s']:.1f}"
            + (f" (vs {base['output_tokens_per_s']:.1f})" if base else ""),
            ratio, f"{spec['acceptance_rate']:.0%}", f"{spec['mean_accepted_length']:.2f}",
            str(device), str(commit),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return ""
    header = "| " + " | ".join(SPECULATIVE_COLUMNS) + " |"
    return "\n".join([header, "|" + "|".join("---" for _ in SPECULATIVE_COLUMNS) + "|", *lines])
