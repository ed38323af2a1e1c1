"""``python -m paper build``: tables and figures from result files only; PDF when a TeX engine exists."""

from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from paper.build import PAPER_DIR, build, referenced_experiments
from paper.results import load_summary
from paper.tables import GENERATED_MARKER, format_cell

REPO = Path(__file__).resolve().parent.parent


def summary(name: str = "leviathan-table1", **overrides) -> dict:
    data = {
        "schema": "specdec.summary/1",
        "experiment": name,
        "title": "T",
        "description": "d",
        "command": f"python -m experiments run {name}",
        "created_at": "2026-01-02T03:04:05Z",
        "smoke": False,
        "complete": True,
        "num_runs": 2,
        "num_planned_runs": 2,
        "missing_run_ids": [],
        "machine": "CPU (AMD EPYC, 2 cores), host vm, torch 2.13.0+cpu",
        "env": {"git_commit": "0123456789abcdef"},
        "notes": "",
        "tables": [
            {
                "name": "main",
                "caption": "Costs \\& speed.",
                "columns": [
                    {"key": "name", "label": "Drafter", "format": "", "align": "l"},
                    {"key": "speed", "label": "Speed", "format": ".2f", "align": "r"},
                    {"key": "gamma", "label": "$\\gamma$", "format": "d", "align": "r"},
                ],
                "rows": [
                    {"name": "n_gram & 50%", "speed": 1.23456, "gamma": 4.0},
                    {"name": "none", "speed": -0.5},
                ],
            }
        ],
        "figures": [
            {
                "name": "curve",
                "caption": "A curve.",
                "xlabel": "$\\alpha$",
                "ylabel": "y",
                "logx": False,
                "logy": False,
                "series": [
                    {"label": "a", "x": [0, 1, 2], "y": [1, 2, 4], "style": "line", "group": "g"},
                    {"label": "b", "x": [0, 1, 2], "y": [1, 2, 3], "style": "markers", "group": "g"},
                ],
            }
        ],
    }
    data.update(overrides)
    return data


def write(results: Path, data: dict) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{data['experiment']}.json").write_text(json.dumps(data))


def test_tables_figures_and_placeholders(tmp_path):
    write(tmp_path / "results", summary())
    write(tmp_path / "results", summary("not-in-main", figures=[]))
    out = tmp_path / "paper"
    report = build(tmp_path / "results", out, compile_pdf=False)
    tex = (out / "tables" / "leviathan-table1.tex").read_text()
    assert tex.startswith(GENERATED_MARKER)
    assert "n\\_gram \\& 50\\% & 1.23 & 4 \\\\" in tex and "none & $-$0.50 & -- \\\\" in tex
    assert "\\label{tab:leviathan-table1-main}" in tex and "\\begin{tabular}{lrr}" in tex
    assert "Source: \\texttt{python -m experiments run leviathan-table1}" in tex
    assert "CPU (AMD EPYC, 2 cores)" in tex and "commit \\texttt{01234567}" in tex and "Smoke" not in tex
    figure_tex = (out / "figures" / "leviathan-table1.tex").read_text()
    assert "\\includegraphics[width=0.85\\linewidth]{figures/leviathan-table1--curve}" in figure_tex
    for suffix in (".pdf", ".png"):
        path = out / "figures" / f"leviathan-table1--curve{suffix}"
        assert path.stat().st_size > 1000
    assert (out / "figures" / "leviathan-table1--curve.png").read_bytes()[:4] == b"\x89PNG"
    referenced = referenced_experiments(out / "main.tex")
    assert {"leviathan-table1", "moe-verify-cost", "switch-tables", "gamma-sweep"} <= referenced["tables"]
    assert "leviathan-table1" not in report.placeholders and "gamma-sweep" in report.placeholders
    assert "No results yet for \\texttt{gamma-sweep}" in (out / "tables" / "gamma-sweep.tex").read_text()
    assert report.unreferenced == ["not-in-main"] and (out / "tables" / "not-in-main.tex").exists()
    assert report.pdf is None and "skipped" in report.pdf_message


def test_captions_flag_smoke_and_partial_results(tmp_path):
    write(tmp_path / "results", summary(smoke=True, complete=False, num_runs=1))
    build(tmp_path / "results", tmp_path / "paper", compile_pdf=False)
    tex = (tmp_path / "paper" / "tables" / "leviathan-table1.tex").read_text()
    assert "Smoke run (tiny sizes, CI only)" in tex and "Partial: 1 of 2 runs" in tex


def test_rebuild_is_byte_identical_and_removes_stale_outputs(tmp_path):
    write(tmp_path / "results", summary())
    out = tmp_path / "paper"
    build(tmp_path / "results", out, compile_pdf=False)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    first = {p: p.read_bytes() for p in files}
    (out / "tables" / "hand-written.tex").write_text("% mine\n")
    (out / "figures" / "old--gone.png").write_bytes(b"stale")
    (out / "tables" / "old.tex").write_text(GENERATED_MARKER + " from results/old.json\n")
    build(tmp_path / "results", out, compile_pdf=False)
    assert {p: p.read_bytes() for p in files} == first
    assert (out / "tables" / "hand-written.tex").exists()
    assert not (out / "figures" / "old--gone.png").exists() and not (out / "tables" / "old.tex").exists()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(schema="other/1"), "expected schema"),
        (lambda d: d.pop("machine"), "lacks the field 'machine'"),
        (
            lambda d: d["tables"][0]["columns"][0].pop("key"),
            r"tables\[0\]\.columns\[0\] lacks the field 'key'",
        ),
        (lambda d: d["figures"][0]["series"][0].update(y=[1]), "x and y differ in length"),
        (lambda d: d.update(smoke="no"), "smoke must be bool"),
        (lambda d: d.update(experiment="../../X"), r"experiment must be an identifier \(\[a-z0-9-\]\+"),
        (lambda d: d["figures"][0].update(name="a/b"), r"figures\[0\]\.name must be an identifier"),
        (lambda d: d["tables"][0].update(name="T 1"), r"tables\[0\]\.name must be an identifier"),
    ],
)
def test_malformed_summaries_are_rejected_with_the_field_named(tmp_path, mutate, match):
    data = summary()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_summary(path)


def test_paths_come_from_the_user_never_from_file_contents(tmp_path):
    """A summary whose experiment field climbs out of --out is refused before anything is written."""
    results, out = tmp_path / "results", tmp_path / "deep" / "out"
    results.mkdir()
    data = summary()
    data["experiment"] = "../../escaped"
    (results / "x.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="must be an identifier"):
        build(results, out, compile_pdf=False)
    assert not list(tmp_path.rglob("escaped*"))


def test_format_cell():
    assert format_cell(None, ".2f") == "--" and format_cell(True, "") == "yes"
    assert format_cell(3.0, "d") == "3" and format_cell(0.1234, ".1%") == "12.3\\%"
    assert format_cell(-1.5, ".1f") == "$-$1.5" and format_cell("a_b", "") == "a\\_b"
    assert format_cell(2.5, "d") == "2.5"  # a spec that does not fit the value falls back to str()


def test_pdf_is_compiled_when_a_tex_engine_is_on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "pdflatex"
    fake.write_text("#!/bin/sh\necho \"$@\" >> calls.txt\nprintf '%%PDF-1.5' > main.pdf\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    if shutil.which("tectonic"):
        pytest.skip("a real tectonic is installed; it would be preferred over the fake pdflatex")
    write(tmp_path / "results", summary())
    report = build(tmp_path / "results", tmp_path / "paper")
    assert report.pdf == tmp_path / "paper" / "main.pdf" and report.pdf.exists()
    calls = (tmp_path / "paper" / "calls.txt").read_text().splitlines()
    assert calls == ["-interaction=nonstopmode -halt-on-error main.tex"] * 2


def test_pdf_step_is_skipped_cleanly_without_tex(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    write(tmp_path / "results", summary())
    report = build(tmp_path / "results", tmp_path / "paper")
    assert report.pdf is None
    assert report.pdf_message.startswith("PDF: skipped (neither tectonic nor pdflatex is installed)")


@pytest.mark.slow
def test_cli_builds_from_the_committed_results(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "paper", "build", "--out", str(tmp_path), "--no-pdf"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "tables:" in done.stdout and "PDF: skipped (--no-pdf)." in done.stdout
    for path in (PAPER_DIR / "results").glob("*.json"):
        assert (tmp_path / "tables" / f"{path.stem}.tex").read_text().startswith(GENERATED_MARKER)


def test_paper_imports_no_project_package():
    forbidden = {"specdec", "moe", "kernels", "experiments"}
    for path in PAPER_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & forbidden, (path.name, names)


def test_import_linter_contracts_hold():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(lint).exists():
        pytest.skip("import-linter is not installed")
    done = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "paper reads result files only KEPT" in done.stdout
