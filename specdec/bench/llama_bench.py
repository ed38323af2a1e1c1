"""llama.cpp's own benchmark binary, ``llama-bench``, run beside ours on the same GGUF file and threads.

Legend: T block length (tokens per forward); ``pp<T>`` llama-bench's prompt test of T tokens (one
forward of T tokens from an empty cache, logits of the last row only); ``tg<N>`` its generation
test of N tokens (one token per forward).

:func:`run_llama_bench` finds the binary (``$LLAMA_BENCH``, else ``llama-bench`` on ``PATH``), runs

    llama-bench -m GGUF -t THREADS -p 1,4,7,16 -n 128 -r REPS -o json

and returns its figures with the binary's version and build options, or a one-line reason why it
did not run (no binary, or no GGUF file). :func:`comparison_rows` puts them beside ours: our decode
tok/s beside ``tg128`` and our T-token forward (T / forward time) beside ``ppT``, each with the
ratio ours / llama-bench. Both benchmarks (``python -m specdec.bench.target``, ``specdec bench
--peers llama.cpp``) use this file; how to build the binary is in docs/targets.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdec.summary import Table, table_from_rows

__all__ = [
    "LLAMA_BENCH_ENV",
    "PROMPT_BLOCKS",
    "GEN_TOKENS",
    "find_llama_tool",
    "find_llama_bench",
    "parse_llama_bench_json",
    "run_llama_bench",
    "comparison_rows",
    "comparison_table",
    "comparison_markdown",
]

LLAMA_BENCH_ENV = "LLAMA_BENCH"
"""The environment variable naming the binary (it wins over ``PATH``)."""
PROMPT_BLOCKS = (1, 4, 7, 16)
"""The ``ppT`` tests run: T = 1 is a decode step, 4..16 the verify blocks speculation pays for."""
GEN_TOKENS = 128
"""The ``tgN`` test run (``tg128``, llama.cpp's usual decode figure)."""
_BUILD_KEYS = (
    "CMAKE_BUILD_TYPE",
    "BUILD_SHARED_LIBS",
    "GGML_NATIVE",
    "GGML_CPU_ALL_VARIANTS",
    "GGML_BACKEND_DL",
    "GGML_OPENMP",
    "GGML_LLAMAFILE",
    "GGML_CPU_REPACK",
)
"""The CMake options that decide how llama.cpp's CPU kernels are built (recorded with the figures)."""
_ISA_PREFIXES = ("GGML_AVX", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AMX", "GGML_SSE")


def find_llama_tool(name: str, env: str) -> Path | None:
    """A llama.cpp binary: ``$env`` when set, else ``name`` on ``PATH``; None without one. An
    ``$env`` that is not an executable file is a ``ValueError``."""
    named = os.environ.get(env)
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ValueError(f"${env}={named!r} is not an executable file (expected {name})")
        return path
    found = shutil.which(name)
    return Path(found) if found else None


def find_llama_bench() -> Path | None:
    """The ``llama-bench`` binary: ``$LLAMA_BENCH`` when set, else ``llama-bench`` on ``PATH``; None
    without one. A ``$LLAMA_BENCH`` that is not an executable file is a ``ValueError``."""
    return find_llama_tool("llama-bench", LLAMA_BENCH_ENV)


def parse_llama_bench_json(text: str, source: str = "llama-bench output") -> dict[str, Any]:
    """llama-bench's ``-o json`` output → the build it reports and one entry per test.

    Returns ``{"build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size",
    "n_threads", "n_depth", "tests": {"pp1": {"tokens_per_second", "stddev", "samples"}, "tg128": ...}}``.
    Output that is not a non-empty list of test objects with ``n_prompt``, ``n_gen`` and
    ``avg_ts`` is a ``ValueError`` naming ``source``."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source}: not JSON ({err}); expected llama-bench -o json output") from None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        got = type(rows).__name__
        raise ValueError(f"{source}: expected a non-empty JSON list of test objects, got {got}")
    tests: dict[str, dict[str, Any]] = {}
    for i, row in enumerate(rows):
        missing = [k for k in ("n_prompt", "n_gen", "avg_ts") if not isinstance(row.get(k), (int, float))]
        if missing:
            raise ValueError(f"{source}: test {i} lacks numeric {', '.join(missing)}")
        n_prompt, n_gen = int(row["n_prompt"]), int(row["n_gen"])
        if (n_prompt > 0) == (n_gen > 0):
            raise ValueError(
                f"{source}: test {i} has n_prompt={n_prompt}, n_gen={n_gen}; expected a pp or a tg test"
            )
        name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
        tests[name] = {
            "tokens_per_second": float(row["avg_ts"]),
            "stddev": float(row.get("stddev_ts") or 0.0),
            "samples": [float(x) for x in row.get("samples_ts") or ()],
        }
    first = rows[0]
    facts = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size", "n_threads")
    return {**{k: first.get(k) for k in facts}, "n_depth": first.get("n_depth", 0), "tests": tests}


def _build_options(binary: Path) -> dict[str, str]:
    """The CPU build options of the build the binary comes from (``CMakeCache.txt`` of
    ``build/bin/..``): the build type, shared libraries, ``GGML_NATIVE`` and the other CPU-kernel
    options, and the ISA options (``GGML_AVX2``, ...) that are on; empty without the file."""
    cache = binary.resolve().parent.parent / "CMakeCache.txt"
    if not cache.is_file():
        return {}
    options = {}
    for line in cache.read_text(errors="replace").splitlines():
        key, eq, value = line.partition("=")
        name = key.partition(":")[0]
        if not eq or line.startswith(("#", "//")):
            continue
        if name in _BUILD_KEYS or (name.startswith(_ISA_PREFIXES) and value.upper() in ("ON", "TRUE")):
            options[name] = value
    return dict(sorted(options.items()))


def _version(binary: Path) -> str:
    """``llama-bench --version`` (its version, commit, compiler and target), one line."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return f"unknown ({err})"
    return " ".join((done.stdout + done.stderr).split()) or "unknown"


def run_llama_bench(
    gguf: Path | None,
    *,
    threads: int,
    repetitions: int = 5,
    prompt_blocks: Sequence[int] = PROMPT_BLOCKS,
    gen_tokens: int = GEN_TOKENS,
    timeout_s: float = 3600.0,
) -> dict[str, Any] | str:
    """Run ``llama-bench`` on ``gguf`` with ``threads`` threads: its parsed figures
    (:func:`parse_llama_bench_json`) plus ``binary``, ``command``, ``version``, ``build_options`` and
    the machine's 1-minute ``load_average`` before and after (llama.cpp's threads spin at barriers,
    so another busy process on the same cores slows it several-fold: the load says if one was there);
    or, where it cannot run (no GGUF file, no binary) or fails, the reason as one line."""
    if threads < 1 or repetitions < 1 or gen_tokens < 1 or not prompt_blocks or min(prompt_blocks) < 1:
        raise ValueError(
            f"run_llama_bench expects threads, repetitions, gen_tokens and every prompt block >= 1, got "
            f"threads={threads}, repetitions={repetitions}, gen_tokens={gen_tokens}, "
            f"prompt_blocks={tuple(prompt_blocks)}"
        )
    if gguf is None:
        return "llama-bench not run: the target does not come as a GGUF file"
    binary = find_llama_bench()
    if binary is None:
        return f"llama-bench not run: no llama-bench on PATH and ${LLAMA_BENCH_ENV} is not set"
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", ",".join(map(str, prompt_blocks))]
    command += ["-n", str(gen_tokens), "-r", str(repetitions), "-o", "json"]
    load_before = os.getloadavg()[0]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as err:
        return f"llama-bench failed: {err}"
    if done.returncode != 0:
        tail = " ".join(done.stderr.split()[-40:])
        return f"llama-bench failed: exit status {done.returncode}: {tail}"
    try:
        figures = parse_llama_bench_json(done.stdout, source=f"{binary} output")
    except ValueError as err:
        return f"llama-bench failed: {err}"
    return {
        "binary": str(binary),
        "command": " ".join(command),
        "version": _version(binary),
        "build_options": _build_options(binary),
        "load_average": [load_before, os.getloadavg()[0]],
        **figures,
    }


def comparison_rows(
    figures: Mapping[str, Any] | str, ours: Mapping[str, Mapping[str, float | None]]
) -> list[dict[str, Any]]:
    """One row for llama-bench and one per label of ``ours``, in the same columns.

    ``ours`` maps a label (a weight format, a method) to its comparable figures in tokens per second:
    ``"tg"`` (its decode) and ``"pp<T>"`` (T / one T-token forward); missing ones stay missing.
    Each of our rows holds the figure under the llama-bench test's name (``tg128``, ``pp4``, ...) and
    the ratio ours / llama-bench under ``<name>_ratio``. Without llama-bench's figures (``figures``
    is the reason it did not run) our rows come without ratios and llama-bench's row says why."""
    tg = f"tg{GEN_TOKENS}"
    names = {"tg": tg} | {f"pp{T}": f"pp{T}" for T in PROMPT_BLOCKS}
    theirs: dict[str, float] = {}
    if isinstance(figures, str):
        rows = [{"engine": "llama-bench", "weights": "not run"}]
    else:
        theirs = {n: t["tokens_per_second"] for n, t in figures["tests"].items()}
        rows = [{"engine": "llama-bench", "weights": figures.get("model_type"), **theirs}]
    for label, values in ours.items():
        row: dict[str, Any] = {"engine": "ours", "weights": label}
        for key, name in names.items():
            value = values.get(key)
            if value is None:
                continue
            row[name] = value
            if theirs.get(name):
                row[f"{name}_ratio"] = value / theirs[name]
        rows.append(row)
    return rows


def _columns() -> list[tuple[str, str, str]]:
    tg = f"tg{GEN_TOKENS}"
    columns = [("engine", "engine", ""), ("weights", "weights", "")]
    columns += [(tg, f"decode / {tg} tok/s", ".1f"), (f"{tg}_ratio", "$\\times$", ".2f")]
    for T in PROMPT_BLOCKS:
        columns += [(f"pp{T}", f"$T={T}$ / pp{T} tok/s", ".1f"), (f"pp{T}_ratio", "$\\times$", ".2f")]
    return columns


def _about(figures: Mapping[str, Any] | str, *, command: bool = True) -> str:
    """One line: the binary's version and build options (and the command), or why it did not run."""
    if isinstance(figures, str):
        return figures
    options = ", ".join(f"{k}={v}" for k, v in figures.get("build_options", {}).items())
    load = figures.get("load_average")
    return (
        f"llama-bench {figures.get('version')} ({figures.get('backends')}, {figures.get('n_threads')} threads"
        + (f", 1-min load {load[0]:.1f} before, {load[1]:.1f} after" if load else "")
        + (f"; {options}" if options else "")
        + (f"): `{figures.get('command')}`" if command else ").")
    )


def _latex(text: str) -> str:
    """Plain text for a LaTeX caption (the results schema's captions are LaTeX)."""
    special = {"\\": r"\textbackslash{}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
    return "".join(special.get(ch, "\\" + ch if ch in "&%$#_{}" else ch) for ch in text)


def comparison_table(figures: Mapping[str, Any] | str, rows: list[dict[str, Any]], what: str) -> Table:
    """The rows of :func:`comparison_rows` as a results-schema table; ``what`` says what our rows are."""
    caption = (
        f"{what} beside llama.cpp's \\texttt{{llama-bench}} on the same GGUF file and threads "
        "($\\times$: ours / llama-bench; pp$T$: a $T$-token prompt from an empty cache, logits of the "
        f"last row only). {_latex(_about(figures, command=False))}"
    )
    return table_from_rows("llama-bench", caption, _columns(), rows)


def comparison_markdown(figures: Mapping[str, Any] | str, rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`comparison_rows` as a Markdown table, under a line naming the binary."""
    columns = _columns()
    lines = [
        _about(figures),
        "",
        "| " + " | ".join(label.replace("$\\times$", "×").replace("$", "") for _, label, _ in columns) + " |",
        "|---|---" + "|---:" * (len(columns) - 2) + "|",
    ]
    for row in rows:
        cells = []
        for key, _, spec in columns:
            value = row.get(key)
            if value is None:
                cells.append("–")
            elif key.endswith("_ratio"):
                cells.append(f"{value:.2f}×")
            else:
                cells.append(format(value, spec) if spec else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
