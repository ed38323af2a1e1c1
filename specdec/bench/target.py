"""Benchmark the native target per weight format: decode speed, forward cost, and where the time goes.

    python -m specdec.bench.target --threads 2 --weights gguf,gguf-q8,fp32,int8,int4 --json target.json

Legend: T block length (tokens per target forward).

For each weight format, side by side in one run (the formats interleaved in every repetition, so a
noisy neighbour slows all alike; medians of ``--repeats``):

- plain greedy decode, tokens per second, against ``transformers``' fp32 ``generate`` on the same
  prompt (and whether the greedy outputs are identical);
- one forward of T = 1 .. ``--max-block`` tokens after ``--context`` cached tokens, and its ratio to
  T = 1 (the verify-cost curve speculative decoding pays);
- the **weight-streaming floor**: the bytes of weights one single-token forward reads, divided by
  this machine's read bandwidth (``x.sum()`` over 512 MB, measured in the same run), and the
  single-token forward's ratio to it;
- the single-token forward split into the weight products (every layer's and the head's packed
  kernels, timed alone on the same inputs) and everything else (attention, RoPE, norms, Python);
- llama.cpp's ``llama-bench`` (``$LLAMA_BENCH`` or on ``PATH``; ``--no-llama-bench`` skips it) on the
  same GGUF file and threads, after ours: its ``tg128`` beside our decode and its ``pp1, pp4, pp7,
  pp16`` beside our T-token forwards (T / forward time), with the ratios
  (:mod:`~specdec.bench.llama_bench`); without the binary a one-line note says it was not run.

The header names the CPU, the kernels' ISA path, the threads and the commit.

``--memory`` measures instead what loading each format costs in memory, on ``--linear-backend``:
each format loaded by ``load_target`` in a fresh process (the formats interleaved, medians of
``--repeats``), after that process loaded the model's config and tokenizer once (the libraries a
load imports, the same for every format; printed apart). ``anon MiB``: the growth of ``RssAnon``
around the load (the process's own memory, not the checkpoint file's mapped pages); ``peak MiB``:
``VmHWM`` during the load over the RSS before it; both as ratios to the first format listed::

    python -m specdec.bench.target --memory --weights fp32,bf16 --linear-backend reference
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.bench.interleave import time_interleaved
from specdec.bench.llama_bench import (
    PROMPT_BLOCKS,
    comparison_markdown,
    comparison_rows,
    comparison_table,
    find_llama_bench,
    run_llama_bench,
)
from specdec.bench.report import benchmark_document, command_line, environment
from specdec.cli_args import ArgumentParser, csv, positive_int
from specdec.summary import Summary, check_experiment_name, table_from_rows, write_results
from specdec.targets.llama import LlamaTarget

__all__ = ["greedy_decode", "read_bandwidth", "forward_curves", "load_memory", "main"]

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@torch.inference_mode()
def greedy_decode(target: Any, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding straight through the Target protocol (prefill, then one token per forward)."""
    n = len(prompt_ids)
    target.reset(1, n + new_tokens + 1)
    out = target.forward(
        torch.tensor([prompt_ids]), torch.tensor([0]), logits_index_BN=torch.tensor([[n - 1]])
    )
    token = out.logits_BTV[:, -1].argmax(-1, keepdim=True)
    generated = [int(token)]
    for pos in range(n, n + new_tokens - 1):
        token = target.forward(token, torch.tensor([pos])).logits_BTV[:, -1].argmax(-1, keepdim=True)
        generated.append(int(token))
    return generated


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """This machine's read bandwidth, bytes per second: the best of ``x.sum()`` over a fresh tensor."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    best = min(time_interleaved({"sum": x.sum}, min_reps=repeats, max_reps=repeats, warmup=0)["sum"])
    return x.numel() * 4 / best


@torch.inference_mode()
def forward_curves(
    targets: dict[str, Any], context: int, max_block: int, seconds: float, extra_blocks: tuple[int, ...] = ()
) -> dict[str, dict[int, float]]:
    """Median ms of one forward of T = 1..max_block tokens (and T in ``extra_blocks``) after
    ``context`` cached tokens, per target, every (target, T) interleaved."""
    blocks = sorted(set(range(1, max_block + 1)) | set(extra_blocks))
    g = torch.Generator().manual_seed(0)
    for target in targets.values():
        target.reset(1, context + blocks[-1] + 1)
        target.forward(torch.randint(0, target.vocab_size, (1, context), generator=g), torch.tensor([0]))

    def one(target: Any, T: int) -> Callable[[], Any]:
        block, start = torch.full((1, T), 100), torch.tensor([context])
        return lambda: (target.forward(block, start), target.rollback(start))

    fns = {(name, T): one(t, T) for name, t in targets.items() for T in blocks}
    times = time_interleaved(fns, seconds=seconds, min_reps=5, max_reps=200)
    return {name: {T: 1e3 * statistics.median(times[(name, T)]) for T in blocks} for name in targets}


@torch.inference_mode()
def product_ms(target: LlamaTarget, repeats: int = 20) -> float:
    """Median ms of every weight product of a single-token forward run alone (each layer's four
    kernels and the head's, on inputs of the right widths): the part of a forward that is the weights."""
    c = target.config
    x_D, x_att = torch.randn(1, c.hidden_size), torch.randn(1, c.num_heads * c.head_dim)
    x_gu = torch.randn(1, 2 * c.intermediate_size)

    def products() -> None:
        for ly in target.layers:
            ly.qkv(x_D)
            ly.o(x_att, x_D)
            ly.gate_up(x_D)
            ly.down(x_gu, x_D)
        target._head(x_D)

    times = time_interleaved({"products": products}, min_reps=repeats, max_reps=repeats, warmup=1)
    return 1e3 * statistics.median(times["products"])


def _decode_tok_s(fns: dict[str, Callable[[], list[int]]], new_tokens: int, repeats: int) -> dict[str, float]:
    """Tokens per second of each greedy decode, the median of ``repeats`` interleaved runs."""
    times = time_interleaved(fns, min_reps=repeats, max_reps=repeats, warmup=0)
    return {name: new_tokens / statistics.median(t) for name, t in times.items()}


def run(args: Any) -> dict[str, Any]:
    """The measurements of :func:`main` (see the module doc)."""
    from specdec.targets.loading import gguf_source, load_hf_model

    if args.llama_bench:
        find_llama_bench()  # a wrong $LLAMA_BENCH is a ValueError before the measurements, not after
    backend = args.linear_backend
    targets = {
        w: LlamaTarget.from_pretrained(args.target, weights=w, linear_backend=backend) for w in args.weights
    }
    first = next(iter(targets.values()))
    prompt_ids = first.tokenizer(PROMPT).input_ids
    hf = load_hf_model(args.target)

    def hf_greedy() -> list[int]:
        x = torch.tensor([prompt_ids])
        with torch.inference_mode():
            y = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=hf.generation_config.eos_token_id,
            )
        return y[0, len(prompt_ids) :].tolist()

    reference = hf_greedy()
    result: dict[str, Any] = {"environment": {**environment(), "target": args.target}, "formats": {}}
    bandwidth = read_bandwidth()
    result["read_bandwidth_gb_s"] = bandwidth / 1e9
    curves = forward_curves(targets, args.context, args.max_block, args.seconds, PROMPT_BLOCKS)
    hf_tok_s = _decode_tok_s({"transformers": hf_greedy}, args.new_tokens, min(args.repeats, 3))
    result["transformers_tok_s"] = hf_tok_s["transformers"]
    decodes = {w: lambda t=t: greedy_decode(t, prompt_ids, args.new_tokens) for w, t in targets.items()}
    same = {w: decode() == reference for w, decode in decodes.items()}  # also the warm-up
    decode_tok_s = _decode_tok_s(decodes, args.new_tokens, args.repeats)  # the formats interleaved
    for w, target in targets.items():
        floor_ms = target.weight_bytes / bandwidth * 1e3
        products = product_ms(target)
        t1 = curves[w][1]
        result["formats"][w] = {
            "weight_mb": target.weight_bytes / 1e6,
            "decode_tok_s": decode_tok_s[w],
            "greedy_equals_transformers": same[w],
            "forward_ms": curves[w],
            "verify_ratio": {T: ms / t1 for T, ms in curves[w].items()},
            "floor_ms": floor_ms,
            "forward_over_floor": t1 / floor_ms,
            "products_ms": products,
            "outside_products_ms": t1 - products,
        }
    if args.llama_bench:
        result["llama_bench"] = run_llama_bench(
            gguf_source(args.target), threads=torch.get_num_threads(), repetitions=args.repeats
        )
        if isinstance(result["llama_bench"], str):
            print(f"note: {result['llama_bench']}", file=sys.stderr)
    return result


def _process_mib() -> dict[str, float]:
    """This process's ``RssAnon``, ``VmRSS`` and ``VmHWM`` in MiB (``/proc/self/status``)."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "VmRSS", "VmHWM")}


def _probe_load_memory(name: str, weights: str, linear_backend: str) -> None:
    """In a fresh process: load the config and tokenizer (the imports), then the target; print JSON."""
    from specdec.targets import load_target
    from specdec.targets.loading import load_hf_config, load_tokenizer, resolve_checkpoint

    start = _process_mib()
    path = resolve_checkpoint(name)
    load_hf_config(path)
    load_tokenizer(path)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM restarts from the RSS now: the peak is the load's own
    before = _process_mib()
    target = load_target(name, weights=weights, linear_backend=linear_backend)
    after = _process_mib()
    anon, peak = after["RssAnon"] - before["RssAnon"], after["VmHWM"] - before["VmRSS"]
    imports = before["RssAnon"] - start["RssAnon"]
    print(json.dumps({"anon_mib": anon, "peak_mib": peak, "imports_mib": imports, "weights": target.weights}))


def load_memory(name: str, weights: Sequence[str], linear_backend: str, repeats: int) -> dict[str, dict]:
    """Medians of :func:`_probe_load_memory` per format, each run in a fresh process, the formats
    interleaved ``repeats`` times (``ValueError`` with the probe's error when a load fails)."""
    runs: dict[str, list[dict]] = {w: [] for w in weights}
    for _ in range(repeats):
        for w in weights:
            call = f"_probe_load_memory({name!r}, {w!r}, {linear_backend!r})"
            code = f"from specdec.bench.target import _probe_load_memory; {call}"
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if done.returncode:
                raise ValueError(f"loading {name} with weights={w!r} failed: {done.stderr.strip()[-2000:]}")
            runs[w].append(json.loads(done.stdout.strip().splitlines()[-1]))
    keys = ("anon_mib", "peak_mib", "imports_mib")
    return {w: {k: statistics.median(r[k] for r in rs) for k in keys} for w, rs in runs.items()}


def memory_report(memory: dict[str, dict], env: dict[str, Any], name: str, linear_backend: str) -> str:
    """The load-memory table under a header naming the machine, with ratios to the first format."""
    first = next(iter(memory))
    base = memory[first]
    imports = statistics.median(m["imports_mib"] for m in memory.values())
    lines = [
        f"CPU: {env['cpu']} (kernels: {env['isa']} path), {env['torch_threads']} threads, commit "
        f"{env['commit']}; load memory of {name}, linear backend {linear_backend}, a fresh process per "
        f"load (after the config and tokenizer's imports: {imports:.0f} MiB, whatever the format)",
        "",
        f"| weights | anon MiB | peak MiB | anon / {first} | peak / {first} |",
        "|---|---|---|---|---|",
    ]
    for w, m in memory.items():
        anon, peak = m["anon_mib"] / base["anon_mib"], m["peak_mib"] / base["peak_mib"]
        lines.append(f"| {w} | {m['anon_mib']:.0f} | {m['peak_mib']:.0f} | {anon:.2f} | {peak:.2f} |")
    return "\n".join(lines) + "\n"


def _vs_llama_bench(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Our formats beside llama-bench: decode tok/s beside tg128, T / (T-token forward) beside ppT."""
    ours = {}
    for w, r in result["formats"].items():
        ms = {int(T): v for T, v in r["forward_ms"].items()}
        ours[w] = {"tg": r["decode_tok_s"]} | {f"pp{T}": 1e3 * T / ms[T] for T in PROMPT_BLOCKS if T in ms}
    return comparison_rows(result["llama_bench"], ours)


def report(result: dict[str, Any]) -> str:
    """The results as text (a Markdown table under a header naming the machine)."""
    env = result["environment"]
    hf = result["transformers_tok_s"]
    blocks = list(next(iter(result["formats"].values()))["forward_ms"])
    head = (
        "| weights | MB | decode tok/s | × transformers | greedy = transformers | T=1 ms | floor ms "
        "| T=1 / floor | products ms | rest ms | " + " | ".join(f"T={T}" for T in blocks) + " |"
    )
    lines = [
        f"CPU: {env['cpu']} (kernels: {env['isa']} path), {env['torch_threads']} threads, "
        f"commit {env['commit']}; read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s; "
        f"transformers fp32 decode {hf:.1f} tok/s",
        "",
        head,
        "|---" * (10 + len(blocks)) + "|",
    ]
    for w, r in result["formats"].items():
        cells = [
            w,
            f"{r['weight_mb']:.0f}",
            f"{r['decode_tok_s']:.1f}",
            f"{r['decode_tok_s'] / hf:.2f}",
            "yes" if r["greedy_equals_transformers"] else "no",
            f"{r['forward_ms'][1]:.1f}",
            f"{r['floor_ms']:.1f}",
            f"{r['forward_over_floor']:.2f}",
            f"{r['products_ms']:.1f}",
            f"{r['outside_products_ms']:.1f}",
            *(f"{x:.2f}×" for x in r["verify_ratio"].values()),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if "llama_bench" in result:
        lines += ["", comparison_markdown(result["llama_bench"], _vs_llama_bench(result))]
    return "\n".join(lines) + "\n"


def summarize(result: dict[str, Any]) -> Summary:
    """The results table (one row per weight format) in the results schema, read from the JSON form
    of ``result`` (string block keys)."""
    hf = result["transformers_tok_s"]
    blocks = list(next(iter(result["formats"].values()))["verify_ratio"])
    rows = []
    for w, r in result["formats"].items():
        row = {k: r[k] for k in ("weight_mb", "decode_tok_s", "floor_ms", "forward_over_floor")}
        row |= {"weights": w, "vs_hf": r["decode_tok_s"] / hf, "t1_ms": r["forward_ms"]["1"]}
        row |= {"greedy": "yes" if r["greedy_equals_transformers"] else "no"}
        rows.append(row | {f"verify_{T}": r["verify_ratio"][T] for T in blocks})
    columns = [
        ("weights", "weights", ""),
        ("weight_mb", "MB", ".0f"),
        ("decode_tok_s", "decode tok/s", ".1f"),
        ("vs_hf", "$\\times$ transformers", ".2f"),
        ("greedy", "greedy = transformers", ""),
        ("t1_ms", "$T=1$ ms", ".1f"),
        ("floor_ms", "floor ms", ".1f"),
        ("forward_over_floor", "$T=1$ / floor", ".2f"),
        *((f"verify_{T}", f"$T={T}$", ".2f") for T in blocks),
    ]
    caption = (
        f"The native target per weight format: decode tok/s (transformers fp32: {hf:.1f}), one-token "
        f"forward against the weight-read floor at {result['read_bandwidth_gb_s']:.1f} GB/s, and the "
        "forward time of a block of $T$ tokens over one token's."
    )
    tables = [table_from_rows("formats", caption, columns, rows)]
    if "llama_bench" in result:
        what = "Our plain greedy decode (prefill included) and $T$-token forwards (after the context)"
        tables.append(comparison_table(result["llama_bench"], _vs_llama_bench(result), what))
    return Summary(title="Native target", tables=tuple(tables))


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.bench.target``."""
    p = ArgumentParser(prog="python -m specdec.bench.target", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m", help="built-in name or local checkpoint")
    p.add_argument(
        "--weights", type=csv(str), default=("gguf", "gguf-q8", "fp32", "bf16", "int8", "int4", "int4-q8")
    )
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--max-block", type=positive_int, default=9)
    p.add_argument("--context", type=positive_int, default=128, help="cached tokens before the timed blocks")
    p.add_argument("--seconds", type=float, default=20.0, help="time budget of the forward-cost curves")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads")
    p.add_argument("--linear-backend", default="auto", help="the targets' linear backend (auto: per format)")
    p.add_argument(
        "--memory", action="store_true", help="measure the load memory per format instead (module doc)"
    )
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument(
        "--name",
        default="target-formats",
        help="the experiment name in the --json file (one per result file of paper/results, e.g. "
        "target-formats-avx2 for a run on another ISA path)",
    )
    p.add_argument(
        "--no-llama-bench",
        dest="llama_bench",
        action="store_false",
        help="do not run llama.cpp's llama-bench ($LLAMA_BENCH or on PATH) beside ours",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.memory:
            memory = load_memory(args.target, args.weights, args.linear_backend, args.repeats)
            print(memory_report(memory, environment(), args.target, args.linear_backend))
            return 0
        check_experiment_name(args.name, "--name")
        result = run(args)
    except ValueError as err:
        print(f"python -m specdec.bench.target: error: {err}", file=sys.stderr)
        return 2
    result["command"] = command_line("python -m specdec.bench.target", argv)
    print(report(result))
    if args.json:
        document = benchmark_document(
            result, experiment=args.name, summarize=summarize, description=__doc__.split("\n")[0]
        )
        write_results(Path(args.json), document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
