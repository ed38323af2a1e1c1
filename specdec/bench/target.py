"""Benchmark the native Llama target against ``transformers`` on the same machine, in one run.

    python -m specdec.targets.llama_bench                 # plain decode vs HF generate, forward cost T=1..9
    python -m specdec.targets.llama_bench --linear        # + the linear backends' cost curves
    python -m specdec.targets.llama_bench --layerskip 18,24,28      # + α, τ, cost, speedup per exit layer

Legend: T block length (tokens per target forward).

Every measurement is repeated ``--repeats`` times, interleaving the contenders (so a noisy
neighbour slows both alike), and the median is reported, always as a ratio next to the absolute
times. Decode rates count prefill + ``--new-tokens`` greedy tokens from the same prompt for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from specdec.targets.linear import LINEAR_BACKENDS
from specdec.targets.llama import LlamaTarget

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
CHAT_PROMPT = "<|im_start|>user\nExplain in detail how a hash table works.<|im_end|>\n<|im_start|>assistant\n"


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


@torch.inference_mode()
def greedy_decode(target: LlamaTarget, prompt_ids: list[int], new_tokens: int) -> list[int]:
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


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_decode(
    target: LlamaTarget, hf_model: Any, prompt_ids: list[int], new_tokens: int, repeats: int
) -> dict:
    """ms per generated token: our greedy decode vs ``transformers`` ``generate(do_sample=False)``."""
    ids = torch.tensor([prompt_ids])
    mask = torch.ones_like(ids)

    def hf() -> list[int]:
        with torch.inference_mode():
            out = hf_model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=hf_model.generation_config.eos_token_id,
            )
        return out[0, len(prompt_ids) :].tolist()

    ours = lambda: greedy_decode(target, prompt_ids, new_tokens)
    same = ours() == hf()  # also a warm-up of both
    samples: dict[str, list[float]] = {"ours": [], "transformers": []}
    for _ in range(repeats):
        samples["transformers"].append(_time(hf) / new_tokens)
        samples["ours"].append(_time(ours) / new_tokens)
    ms = {k: _median_ms(v) for k, v in samples.items()}
    return {
        "ms_per_token": ms,
        "tokens_per_second": {k: 1e3 / v for k, v in ms.items()},
        "speedup_vs_transformers": ms["transformers"] / ms["ours"],
        "greedy_output_identical": same,
    }


@torch.inference_mode()
def bench_forward_curve(
    targets: dict[str, LlamaTarget],
    context: int,
    max_block: int,
    repeats: int,
    num_layers: int | None = None,
    setup: dict[str, Callable[[], Any]] | None = None,
) -> dict[str, dict[int, float]]:
    """Median ms of one forward of T = 1..max_block tokens after ``context`` cached tokens, per target
    (interleaved; ``setup[name]()``, where given, runs before each of that entry's forwards, so one
    target can appear under two names with different process-wide kernel settings)."""
    setup = setup or {}
    g = torch.Generator().manual_seed(0)
    for target in targets.values():
        target.reset(1, context + max_block + 1)
        target.forward(torch.randint(0, target.vocab_size, (1, context), generator=g), torch.tensor([0]))
    samples = {name: {T: [] for T in range(1, max_block + 1)} for name in targets}
    for _ in range(repeats):
        for T in range(1, max_block + 1):
            for name, target in targets.items():
                block = torch.randint(0, target.vocab_size, (1, T), generator=g)
                start = torch.tensor([context])
                if name in setup:
                    setup[name]()
                t0 = time.perf_counter()
                if num_layers is None:
                    target.forward(block, start)
                else:
                    target.forward_layers(block, start, num_layers=num_layers)
                samples[name][T].append(time.perf_counter() - t0)
                target.rollback(torch.tensor([context]))
    return {name: {T: _median_ms(v) for T, v in per_T.items()} for name, per_T in samples.items()}


def bench_layerskip(
    target: LlamaTarget,
    prompts: list[list[int]],
    exits: list[int],
    gammas: list[int],
    new_tokens: int,
    repeats: int,
) -> list[dict]:
    """α, τ, draft cost and speedup over plain decoding per exit layer N and γ (greedy, ``specdec.generate``).

    The plain baseline runs through the same loop (drafter ``none``), interleaved with each run.
    """
    import specdec

    def run(**kw: Any) -> Any:
        return specdec.generate(target, prompts, temperature=0.0, max_new_tokens=new_tokens, **kw)

    t_target = bench_forward_curve({"t": target}, 64, 1, repeats)["t"][1]
    rows = []
    for n in exits:
        t_draft = bench_forward_curve({"d": target}, 64, 1, repeats, num_layers=n)["d"][1]
        for gamma in gammas:
            plain, spec, out = [], [], None
            for _ in range(repeats):
                plain.append(run(drafter="none").metrics.tokens_per_second)
                out = run(drafter="layerskip", drafter_options={"num_layers": n}, gamma=gamma)
                spec.append(out.metrics.tokens_per_second)
            rows.append(
                {
                    "num_layers": n,
                    "gamma": gamma,
                    "alpha": out.metrics.acceptance_rate,
                    "tau": out.metrics.mean_accepted_tokens,
                    "draft_cost_ratio": t_draft / t_target,
                    "speedup_vs_plain": statistics.median(spec) / statistics.median(plain),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m specdec.targets.llama_bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", default="smollm2-135m", help="built-in name or local checkpoint")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-block", type=int, default=9)
    p.add_argument("--context", type=int, default=128, help="cached tokens before the timed forward blocks")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="our linear weights")
    p.add_argument("--linear", action="store_true", help="also time every linear backend's forward curve")
    p.add_argument("--layerskip", default="", help="comma-separated exit layers to sweep, e.g. 12,18,24")
    p.add_argument("--layerskip-gamma", default="1,3", help="comma-separated γ for the layerskip sweep")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from specdec.targets.loading import load_hf_model

    dtype = getattr(torch, args.dtype)
    target = LlamaTarget.from_pretrained(args.target, dtype=dtype)
    hf_model = load_hf_model(args.target)
    prompt_ids = target.tokenizer(PROMPT).input_ids
    print(
        f"# {args.target}: ours ({args.dtype} weights, linear backend {target.linear_backend!r}) vs "
        f"transformers fp32, {torch.get_num_threads()} threads, median of {args.repeats}"
    )

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    print(
        f"# load average at start: {load:.2f}"
        + ("  (busy machine: expect noisy numbers)" if load > 1 else "")
    )
    results: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "backend": target.linear_backend,
        "dtype": args.dtype,
    }
    dec = bench_decode(target, hf_model, prompt_ids, args.new_tokens, args.repeats)
    results["decode"] = dec
    print(f"plain greedy decode, {args.new_tokens} new tokens (prefill included):")
    for name in ("transformers", "ours"):
        print(
            f"  {name:13s} {dec['ms_per_token'][name]:7.2f} ms/token"
            f" {dec['tokens_per_second'][name]:6.1f} tok/s"
        )
    print(
        f"  speedup ours / transformers: {dec['speedup_vs_transformers']:.2f}x   "
        f"(greedy output identical: {dec['greedy_output_identical']})"
    )

    contenders = {"ours": target}
    if args.linear:
        for backend in sorted(LINEAR_BACKENDS):
            if backend != target.linear_backend:
                contenders[backend] = LlamaTarget.from_pretrained(
                    args.target, dtype=dtype, linear_backend=backend, load_tokenizer=False
                )
    setup: dict[str, Callable[[], Any]] = {}
    if target.linear_backend == "packed":
        # The packed kernel's software prefetch for multi-row passes, against the hardware prefetchers
        # alone, in the same run (kernels/csrc/packed_gemm.c).
        from kernels.packed_gemm import prefetch_distance, set_prefetch_distance

        distance = prefetch_distance()
        contenders["no sw prefetch"] = target
        setup = {
            name: (lambda d=(0 if name == "no sw prefetch" else distance): set_prefetch_distance(d))
            for name in contenders
        }
    curves = bench_forward_curve(contenders, args.context, args.max_block, args.repeats, setup=setup)
    if setup:
        set_prefetch_distance(distance)
    results["forward_ms"] = curves
    print(f"target forward cost after {args.context} cached tokens, ms (and ratio to T=1):")
    print("  " + " " * 15 + "".join(f"{'T=' + str(T):>15s}" for T in range(1, args.max_block + 1)))
    for name, per_T in curves.items():
        label = f"{name} ({target.linear_backend})" if name == "ours" else name
        cells = "".join(f"{ms:7.1f} ({ms / per_T[1]:4.2f}x)" for ms in per_T.values())
        print(f"  {label:15s}{cells}")

    if args.layerskip:
        exits = [int(n) for n in args.layerskip.split(",")]
        gammas = [int(g) for g in args.layerskip_gamma.split(",")]
        prompts = [prompt_ids, target.tokenizer(CHAT_PROMPT).input_ids]
        rows = bench_layerskip(target, prompts, exits, gammas, args.new_tokens, min(args.repeats, 3))
        results["layerskip"] = rows
        print("layerskip (greedy, 2 prompts): α, τ, draft cost per token / target T=1 cost, speedup vs plain")
        for r in rows:
            print(
                f"  N={r['num_layers']:3d} γ={r['gamma']}  α={r['alpha']:.3f}  τ={r['tau']:.2f}  "
                f"draft/target={r['draft_cost_ratio']:.2f}  speedup={r['speedup_vs_plain']:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
