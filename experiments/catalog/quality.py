"""``quality``: what each weight format costs in quality, measured as llama.cpp measures it.

Perplexity (± llama.cpp's standard error), mean and 99th-percentile KL divergence against ``fp32``
and top-1 agreement, with ``llama-perplexity``'s protocol (:mod:`specdec.quality.perplexity`:
chunks of ``ctx`` tokens from an empty cache, the second half scored) on the held-out Python
documentation topics (:mod:`specdec.quality.text`: text every Python install has, kept out of
drafter training). Formats: ``fp32`` (the reference), ``bf16``, ``gguf`` (the file's blocks, float
activations: the same function as ``fp32`` on the dequantised weights), ``gguf-q8`` (the default:
8-bit activations), ``int8-q8`` and ``int4-q8``. ``specdec perplexity`` runs the same measurement
with llama.cpp's tool beside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from experiments.catalog.specdec_runs import TINY_TARGET, tiny_checkpoint, torch_threads
from experiments.config import validate_config
from experiments.experiment import Experiment
from experiments.runner import RunContext
from experiments.store import RunRecord
from experiments.sweep import Sweep
from specdec.quality import report
from specdec.summary import Summary, table_from_rows

__all__ = ["WEIGHTS", "QualityConfig", "plan", "run_quality", "summarize", "EXPERIMENT"]

WEIGHTS = ("fp32", "bf16", "gguf", "gguf-q8", "int8-q8", "int4-q8")
"""The formats compared, the first the KL reference."""


@dataclass(frozen=True, kw_only=True)
class QualityConfig:
    """One target, its formats (the first the reference), ctx and number of chunks."""

    target: str = "smollm2-135m"
    weights: tuple[str, ...] = WEIGHTS
    ctx: int = 256
    chunks: int = 16
    bos: str = "auto"
    num_threads: int = 1

    def __post_init__(self) -> None:
        validate_config(self)
        from specdec.quality.perplexity import BOS_MODES
        from specdec.targets.llama_weights import WEIGHT_MODES

        if not self.weights or len(set(self.weights)) != len(self.weights):
            raise ValueError(f"weights must be distinct formats, at least one, got {self.weights}")
        unknown = [w for w in self.weights if w not in WEIGHT_MODES]
        if unknown:
            raise ValueError(f"weights must be formats from {WEIGHT_MODES}, got {unknown}")
        if self.ctx < 4 or self.ctx % 2 or self.chunks < 1 or self.num_threads < 0:
            raise ValueError(
                f"need an even ctx >= 4, chunks >= 1, num_threads >= 0; got ctx={self.ctx}, "
                f"chunks={self.chunks}, num_threads={self.num_threads}"
            )
        if self.bos not in BOS_MODES:
            raise ValueError(f"bos must be one of {BOS_MODES}, got {self.bos!r}")


def plan(*, smoke: bool = False) -> Sweep:
    """SmolLM2-135M in every format at ctx 256 (smoke: the tiny target's float and quantised formats)."""
    if smoke:
        base = QualityConfig(
            target=TINY_TARGET, weights=("fp32", "bf16", "int8-q8", "int4-q8"), ctx=32, chunks=2
        )
        return Sweep(base, {})
    return Sweep(QualityConfig(), {})


def run_quality(config: QualityConfig, ctx: RunContext) -> dict:
    """Load the target in each format, score the held-out pydoc text chunk by chunk, return the record."""
    from specdec.quality.perplexity import evaluate_text
    from specdec.quality.text import pydoc_text, text_info
    from specdec.targets import load_target

    path = str(tiny_checkpoint()) if config.target == TINY_TARGET else config.target
    text = pydoc_text().removesuffix("\n")  # as `specdec perplexity --text` reads the written file
    with torch_threads(config.num_threads) as threads:
        targets = {w: load_target(path, weights=w) for w in config.weights}

        def progress(done: int, total: int, stats, elapsed_s: float) -> None:
            ctx.log(
                {"chunk": done, "elapsed_s": elapsed_s, **{f"ppl/{n}": s.ppl() for n, s in stats.items()}}
            )

        record = evaluate_text(
            targets,
            text,
            tokenizer=targets[config.weights[0]].tokenizer,
            ctx=config.ctx,
            chunks=config.chunks,
            bos=config.bos,
            reference=config.weights[0],
            progress=progress,
        )
    info = text_info(text)
    return {
        "target": config.target,
        **record,
        "text": {**info, "name": "the held-out pydoc topics", "n_tokens": record["text_tokens"]},
        "torch_threads": threads,
    }


def summarize(records: Sequence[RunRecord]) -> Summary:
    """One table: a row per (target, ctx, format)."""
    rows, caption = [], "Perplexity per weight format."
    for rec in sorted(records, key=lambda r: (r.config.target, r.config.ctx)):
        caption = report.table(rec.result).caption
        rows += [
            {"target": rec.config.target, "ctx": rec.config.ctx, **row} for row in report.rows(rec.result)
        ]
    columns = [("target", "target", ""), ("ctx", "ctx", "d")] + report.COLUMNS[1:]
    return Summary(
        title="Quality per weight format: perplexity and KL divergence against fp32",
        tables=(table_from_rows("quality", caption, columns, rows),),
    )


EXPERIMENT = Experiment(
    name="quality",
    description="PPL, KL divergence (mean, p99) and top-1 agreement against fp32 for fp32/bf16/gguf/gguf-q8/"
    "int8-q8/int4-q8 on the held-out pydoc topics (llama-perplexity's protocol)",
    plan=plan,
    runners={QualityConfig: run_quality},
    summarize=summarize,
)
