"""``python -m paper build``: regenerate tables/figures from result files, then compile the PDF if possible.

Reads ``<results>/*.json`` (default ``paper/results``), writes ``<out>/tables/<experiment>.tex``,
``<out>/figures/<experiment>.tex`` and ``<out>/figures/<experiment>--<figure>.pdf|png`` (default out:
``paper/``). Every ``\\input{tables/X}`` or ``\\input{figures/X}`` in ``main.tex`` without a result
gets a placeholder, so the paper always compiles. No computation happens here: numbers are only
formatted. The PDF is compiled with ``tectonic`` or ``pdflatex`` when one is installed; otherwise
that step is skipped with a message.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from paper.figures import figure_stem, render_figure, render_figure_floats
from paper.results import load_summaries
from paper.tables import GENERATED_MARKER, placeholder, render_tables

__all__ = ["PAPER_DIR", "BuildReport", "build", "referenced_experiments", "main"]

PAPER_DIR = Path(__file__).resolve().parent
_INPUT = re.compile(r"^[^%\n]*\\input\{(tables|figures)/([A-Za-z0-9_-]+)(?:\.tex)?\}", re.MULTILINE)


@dataclass
class BuildReport:
    """What a build wrote."""

    tables: list[Path] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
    placeholders: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)
    pdf: Path | None = None
    pdf_message: str = ""


def referenced_experiments(main_tex: Path) -> dict[str, set[str]]:
    """Experiments that ``main.tex`` inputs, as ``{"tables": {...}, "figures": {...}}`` (comments skipped)."""
    found: dict[str, set[str]] = {"tables": set(), "figures": set()}
    for kind, name in _INPUT.findall(Path(main_tex).read_text()):
        found[kind].add(name)
    return found


def _clean_generated(out: Path) -> None:
    """Remove files an earlier build generated (marked .tex files, ``*--*`` figure images)."""
    for folder in (out / "tables", out / "figures"):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.suffix == ".tex" and path.read_text().startswith(GENERATED_MARKER):
                path.unlink()
            elif path.suffix in (".pdf", ".png") and "--" in path.stem:
                path.unlink()


def _compile(out: Path) -> tuple[Path | None, str]:
    tectonic, pdflatex = shutil.which("tectonic"), shutil.which("pdflatex")
    if tectonic:
        commands = [[tectonic, "--keep-logs", "main.tex"]]
    elif pdflatex:
        commands = [[pdflatex, "-interaction=nonstopmode", "-halt-on-error", "main.tex"]] * 2
    else:
        return (
            None,
            "PDF: skipped (neither tectonic nor pdflatex is installed); tables and figures are up to date.",
        )
    for command in commands:
        done = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
            raise RuntimeError(f"{Path(command[0]).name} failed on {out / 'main.tex'}:\n{tail}")
    return out / "main.pdf", f"PDF: {out / 'main.pdf'} ({Path(commands[0][0]).name})"


def build(
    results_dir: Path = PAPER_DIR / "results", out: Path = PAPER_DIR, *, compile_pdf: bool = True
) -> BuildReport:
    """Regenerate ``out/tables`` and ``out/figures`` from ``results_dir``; compile the PDF if TeX exists.

    When ``out`` is not the paper folder, ``main.tex`` is copied there so the PDF can be compiled in place.
    """
    results_dir, out = Path(results_dir), Path(out)
    if not results_dir.is_dir():
        raise ValueError(f"results_dir {results_dir} is not a folder")
    summaries = load_summaries(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    main_tex = out / "main.tex"
    if out.resolve() != PAPER_DIR.resolve():
        shutil.copyfile(PAPER_DIR / "main.tex", main_tex)
    (out / "tables").mkdir(exist_ok=True)
    (out / "figures").mkdir(exist_ok=True)
    _clean_generated(out)
    report = BuildReport()
    for name, summary in summaries.items():
        source = f"results/{name}.json"
        table_path = out / "tables" / f"{name}.tex"
        table_path.write_text(render_tables(summary, source))
        report.tables.append(table_path)
        (out / "figures" / f"{name}.tex").write_text(render_figure_floats(summary, source))
        for figure in summary["figures"]:
            report.figures += render_figure(figure, out / "figures" / figure_stem(name, figure["name"]))
    referenced = referenced_experiments(main_tex)
    for kind in ("tables", "figures"):
        for name in sorted(referenced[kind] - set(summaries)):
            path = out / kind / f"{name}.tex"
            path.write_text(placeholder(name) if kind == "tables" else f"{GENERATED_MARKER} (placeholder)\n")
            if name not in report.placeholders:
                report.placeholders.append(name)
    report.unreferenced = sorted(set(summaries) - referenced["tables"] - referenced["figures"])
    if compile_pdf:
        report.pdf, report.pdf_message = _compile(out)
    else:
        report.pdf_message = "PDF: skipped (--no-pdf)."
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paper build [--results DIR] [--out DIR] [--no-pdf]``."""
    parser = argparse.ArgumentParser(prog="python -m paper", description="Build the paper from result files.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "build", help="regenerate tables/ and figures/ from results/, then compile if possible"
    )
    b.add_argument(
        "--results", type=Path, default=PAPER_DIR / "results", help="summaries folder (paper/results)"
    )
    b.add_argument(
        "--out", type=Path, default=PAPER_DIR, help="where tables/, figures/ and the PDF go (paper/)"
    )
    b.add_argument("--no-pdf", action="store_true", help="do not compile the PDF")
    args = parser.parse_args(argv)
    try:
        report = build(args.results, args.out, compile_pdf=not args.no_pdf)
    except ValueError as e:
        parser.error(str(e))
    print(f"tables: {len(report.tables)} written under {args.out / 'tables'}")
    print(f"figures: {len(report.figures)} files written under {args.out / 'figures'}")
    if report.placeholders:
        print(f"placeholders (no results yet): {', '.join(report.placeholders)}")
    if report.unreferenced:
        print(f"results not referenced by main.tex: {', '.join(report.unreferenced)}")
    print(report.pdf_message)
    return 0
