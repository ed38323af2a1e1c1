"""Benchmarks of the speculative-decoding engine, every method side by side in one run.

- ``specdec bench`` / ``python -m specdec.bench`` (:mod:`~specdec.bench.speculative`): our engine
  per drafter against our plain decode, ``transformers``' ``generate`` and peers, on HumanEval
  and MT-Bench prompts; results in ``bench.json`` / ``bench.md`` (:mod:`~specdec.bench.report`);
- ``python -m specdec.bench.target`` (:mod:`~specdec.bench.target`): the native target's plain
  decode against ``transformers``, and its forward cost against block length;
- :mod:`~specdec.bench.interleave`: the one interleaved runner both use (and the experiments);
- :mod:`~specdec.bench.llama_bench`: llama.cpp's ``llama-bench`` on the same GGUF file, beside both.

The MoE layer's benchmarks live in ``experiments/`` (``bench_moe`` and the GPU one): ``specdec``
does not depend on ``moe``.
"""

from specdec.bench.interleave import Prompt, run_interleaved, time_interleaved
from specdec.bench.report import PromptResult, markdown_table, summarize
from specdec.bench.speculative import BenchConfig, add_arguments, main, run_bench
from specdec.prompt_sets import (
    PROMPT_SETS,
    humaneval_prompts,
    load_prompts,
    mtbench_prompts,
    mtbench_questions,
)

__all__ = [
    "BenchConfig",
    "PROMPT_SETS",
    "Prompt",
    "PromptResult",
    "humaneval_prompts",
    "load_prompts",
    "markdown_table",
    "mtbench_prompts",
    "mtbench_questions",
    "summarize",
    "run_bench",
    "run_interleaved",
    "time_interleaved",
    "add_arguments",
    "main",
]
