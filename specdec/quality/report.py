"""The perplexity results as a table: one row per set of weights, llama.cpp's beside.

The record is what ``specdec perplexity --out`` writes (and the ``quality`` experiment returns):
``weights`` (name → :meth:`specdec.quality.perplexity.RunningStats.result`), ``reference``,
``peers`` (name → ``{"ppl", "ppl_stderr", ...}``, with ``tokens``: its tokens of the text against
ours, :func:`specdec.quality.tokens.compare_tokens`, and ``ours_on_its_tokens``: every format scored
on them) and the run's sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specdec.quality.tokens import describe
from specdec.summary import Summary, Table, table_from_rows

__all__ = ["COLUMNS", "rows", "table", "summarize", "markdown"]

COLUMNS = [
    ("engine", "engine", ""),
    ("weights", "weights", ""),
    ("ppl", "PPL", ".4f"),
    ("ppl_stderr", "$\\pm$", ".4f"),
    ("ppl_vs_reference", "PPL / ref.", ".4f"),
    ("kld_mean", "mean KLD", ".3g"),
    ("kld_p99", "KLD p99", ".3g"),
    ("top1_agree", "same top-1", ".4f"),
]
"""(key, LaTeX label, format) of the table's columns."""


def _ours(engine: str, weights: Mapping[str, Any], reference: str | None) -> list[dict[str, Any]]:
    """One row per set of our weights, its PPL over the reference's beside."""
    ref = weights.get(reference or "", {}).get("ppl")
    out = []
    for name, r in weights.items():
        row = {"engine": engine, "weights": name, **{k: r.get(k) for k, _, _ in COLUMNS[2:] if k in r}}
        row["ppl_vs_reference"] = r["ppl"] / ref if ref and r.get("ppl") else None
        out.append(row)
    return out


def rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Ours per weights (PPL over the reference's beside), then each peer's estimate, then ours on
    the peer's tokens where they were scored (``--peer-tokens``)."""
    reference = record.get("reference")
    out = _ours("ours", record["weights"], reference)
    ref = record["weights"].get(reference or "", {}).get("ppl")
    for peer, r in (record.get("peers") or {}).items():
        out.append(
            {
                "engine": peer,
                "weights": r.get("weights", "gguf"),
                "ppl": r.get("ppl"),
                "ppl_stderr": r.get("ppl_stderr"),
                "ppl_vs_reference": r["ppl"] / ref if ref and r.get("ppl") else None,
            }
        )
        if r.get("ours_on_its_tokens"):
            out += _ours(f"ours, {peer}'s tokens", r["ours_on_its_tokens"]["weights"], reference)
    return out


def _sizes(record: Mapping[str, Any]) -> str:
    text = record.get("text") or {}
    return (
        f"{record.get('target')}, ctx {record.get('ctx')}, {record.get('n_chunks')} chunks "
        f"({record.get('tokens_scored')} scored tokens) of {text.get('name', 'the text')} "
        f"({text.get('n_tokens')} tokens), first token {record.get('bos')}"
    )


def table(record: Mapping[str, Any], name: str = "perplexity") -> Table:
    """:func:`rows` as a results-schema table."""
    caption = (
        f"Perplexity with llama.cpp's \\texttt{{llama-perplexity}} protocol: {_sizes(record)}. Each chunk "
        "from an empty cache, its second half scored; $\\pm$: llama.cpp's standard error. KLD: "
        f"KL(\\texttt{{{record.get('reference')}}} $\\|$ weights) per scored token over the whole "
        "vocabulary (mean, 99th percentile); same top-1: the argmaxes agree."
    )
    for peer, r in (record.get("peers") or {}).items():
        binary = Path(str(r.get("binary", peer))).name
        caption += (
            f" {peer}: \\texttt{{{binary}}} on the same GGUF file, text and ctx, over its own tokens "
            f"({r.get('n_chunks')} chunks)."
        )
        tokens = r.get("tokens") or {}
        if tokens.get("scored_equal") is False:
            caption += (
                f" Its tokens differ from ours (first at token {tokens['first_different']}, "
                f"{tokens['places']} places): its PPL is not comparable with ours"
                + (
                    f"; ours on its tokens: the rows `ours, {peer}'s tokens'."
                    if r.get("ours_on_its_tokens")
                    else "."
                )
            )
        elif tokens.get("scored_equal"):
            caption += " Its scored tokens are ours."
    return table_from_rows(name, caption.replace("_", "\\_"), COLUMNS, rows(record))


def summarize(record: Mapping[str, Any]) -> Summary:
    """The perplexity results file's summary part: one table."""
    return Summary(title="Perplexity and KL divergence per weight format", tables=(table(record),))


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    return format(value, fmt) if fmt and isinstance(value, (int, float)) else str(value)


def markdown(record: Mapping[str, Any]) -> str:
    """:func:`rows` as a Markdown table under a line naming the sizes."""
    labels = ["engine", "weights", "PPL", "±", "PPL / ref.", "mean KLD", "KLD p99", "same top-1"]
    lines = [_sizes(record), "", "| " + " | ".join(labels) + " |", "|" + "---|" * len(labels)]
    for row in rows(record):
        lines.append("| " + " | ".join(_cell(row.get(k), fmt) for k, _, fmt in COLUMNS) + " |")
    notes = []
    for peer, r in (record.get("peers") or {}).items():
        if "tokens" in r:
            hint = r["tokens"].get("scored_equal") is False and not r.get("ours_on_its_tokens")
            notes.append(
                describe(peer, r["tokens"]) + (" `--peer-tokens` scores ours on its tokens." if hint else "")
            )
    return "\n".join(lines + ([""] + notes if notes else []))
