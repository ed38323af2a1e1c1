"""Matplotlib figures from summary figure data (x/y series); byte-stable output for committed files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from paper.tables import GENERATED_MARKER, provenance

__all__ = ["figure_stem", "render_figure", "render_figure_floats"]

_STYLES: dict[str, dict[str, Any]] = {
    "line": {"linestyle": "-", "marker": None},
    "dashed": {"linestyle": "--", "marker": None},
    "markers": {"linestyle": "none", "marker": "o", "markersize": 3.5},
    "line+markers": {"linestyle": "-", "marker": "o", "markersize": 3.5},
    "step": {"linestyle": "-", "marker": None, "drawstyle": "steps-post"},
}
# Fixed metadata so that rebuilding unchanged results rewrites identical files.
_METADATA = {"pdf": {"CreationDate": None, "Creator": None, "Producer": None}, "png": {"Software": None}}


def figure_stem(experiment: str, name: str) -> str:
    """File stem of a figure: ``<experiment>--<name>``."""
    return f"{experiment}--{name}"


def render_figure(
    figure: Mapping[str, Any], stem: Path, formats: Sequence[str] = ("pdf", "png")
) -> list[Path]:
    """Draw one summary figure to ``stem.<fmt>`` for each format; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_of: dict[str, str] = {}
    legend_outside = len(figure["series"]) > 6
    fig, ax = plt.subplots(figsize=(7.2 if legend_outside else 5.0, 3.4), dpi=150)
    try:
        for series in figure["series"]:
            group = series.get("group") or series["label"]
            color = color_of.setdefault(group, colors[len(color_of) % len(colors)])
            style = _STYLES.get(series.get("style", "line"), _STYLES["line"])
            ax.plot(series["x"], series["y"], label=series["label"], color=color, linewidth=1.4, **style)
        ax.set_xlabel(figure["xlabel"])
        ax.set_ylabel(figure["ylabel"])
        if figure.get("logx"):
            ax.set_xscale("log")
        if figure.get("logy"):
            ax.set_yscale("log")
        if figure.get("ymin") is not None or figure.get("ymax") is not None:
            ax.set_ylim(figure.get("ymin"), figure.get("ymax"))
        ax.grid(True, alpha=0.3)
        if legend_outside:
            ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        elif figure["series"]:
            ax.legend(fontsize=7, frameon=False)
        fig.tight_layout()
        paths = []
        for fmt in formats:
            path = stem.with_suffix(f".{fmt}")
            fig.savefig(path, format=fmt, metadata=_METADATA.get(fmt))
            paths.append(path)
    finally:
        plt.close(fig)
    return paths


def render_figure_floats(summary: Mapping[str, Any], source: str) -> str:
    """The ``figures/<experiment>.tex`` file: one figure float per summary figure."""
    head = f"{GENERATED_MARKER} from {source}; do not edit.\n"
    floats = []
    for figure in summary["figures"]:
        stem = figure_stem(summary["experiment"], figure["name"])
        floats.append(
            "\n".join(
                [
                    r"\begin{figure}[!htbp]",
                    r"\centering",
                    rf"\includegraphics[width=0.85\linewidth]{{figures/{stem}}}",
                    rf"\caption{{{figure['caption']} {provenance(summary)}}}",
                    rf"\label{{fig:{summary['experiment']}-{figure['name']}}}",
                    r"\end{figure}",
                ]
            )
        )
    if not floats:
        return head + f"% {summary['experiment']} has no figures.\n"
    return head + "\n\n".join(floats) + "\n"
