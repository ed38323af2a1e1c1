"""How far EAGLE drafting runs from its weight-streaming floor, per engine step.

    python -m specdec.bench.draft_floor --rows 1,8 --depth 3 --num-prompts 8 --max-new-tokens 64 --out DIR

Legend: G rows drafting in a step, K the draft depth, B bytes.

The engine runs the shipped head (``--drafter``, default ``eagle``) at a fixed depth K for G requests
at once (held-out chat prompts, ``--rows`` levels), greedy and sampled (T = ``--temperature``). Its
slot drafter's ``propose`` and ``observe`` calls are timed where the engine makes them: their sum over
the steps that drafted, per such step, is the **drafting time per engine step** (the catch-up of the
committed tokens, the K head positions and the bookkeeping), with the catch-up's part apart.

The **floor** is what streaming the head's weights costs: a step runs the head layer K times (one
extend over the tokens just committed, then K − 1 single-token forwards) and the LM head over the
draft vocabulary K times, so it reads ``K · (layer bytes + LM-head bytes)`` (+ the fused input's
auxiliary projection once, in the extend), over this machine's read bandwidth (``x.sum()`` over
512 MB, measured in the same run: :func:`specdec.bench.target.read_bandwidth`). The weights stream
once per forward whatever G, so the floor is the same at every G. The ratio measured / floor is how
much of a step is something else than weights (attention, sampling, Python, the catch-up's queue).

The header names the CPU, the kernels' ISA path, the threads and the commit.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.bench.report import benchmark_document, command_line, environment, machine_line
from specdec.cli_args import ArgumentParser, csv, finite_float, positive_int
from specdec.summary import Summary, table_from_rows, write_results

__all__ = ["head_bytes", "measure_level", "summarize", "main"]


def head_bytes(head: Any) -> dict[str, int]:
    """The bytes a packed EAGLE head reads per forward: its layer (the fused input's ``fc``, attention,
    MLP), its LM head over the draft vocabulary, and the auxiliary projection (EAGLE-3's fused layers,
    read in the extend only; 0 without)."""
    layer = sum(
        lin.nbytes for lin in (head.fc, head.qkv_proj, head.o_proj, head.gate_up_proj, head.down_proj)
    )
    aux = head.fc_aux.nbytes if head.fc_aux is not None else 0
    return {"layer": layer, "lm_head": head.lm_head.nbytes, "aux": aux}


class _Timed:
    """The engine's slot drafter with its ``propose`` and ``observe`` timed: seconds per step that
    drafted (a step's ``observe`` calls join the ``propose`` before them), and each such step's
    catch-up (the proposal's ``catch_up_s``)."""

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter
        self.steps: list[float] = []
        self.catch_up: list[float] = []
        self._propose, self._observe = drafter.propose, drafter.observe
        drafter.propose, drafter.observe = self.propose, self.observe

    def propose(self, call: Any) -> Any:
        t0 = time.perf_counter()
        out = self._propose(call)
        if any(d > 0 for d in call.depths):
            self.steps.append(time.perf_counter() - t0)
            self.catch_up.append(out.catch_up_s)
        return out

    def observe(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._observe(*args, **kwargs)
        if self.steps:
            self.steps[-1] += time.perf_counter() - t0
        return out


def measure_level(
    target: Any,
    prompts: list[list[int]],
    *,
    drafter: str,
    rows: int,
    depth: int,
    temperature: float,
    max_new_tokens: int,
    drafter_options: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """One level: ``rows`` requests at once, every step drafting ``depth``; median seconds per drafting
    step (drafting, and the catch-up within it), the steps counted and the bytes of the head its
    drafter runs (:func:`head_bytes`; ``ValueError`` naming ``--drafter`` where it runs none).
    ``drafter_options``, ``max_model_len``: the engine's."""
    from specdec.engine import Engine

    engine = Engine(
        target,
        drafter=drafter,
        drafter_options=drafter_options,
        gamma=depth,
        max_num_seqs=rows,
        max_model_len=max_model_len,
        measure_cost=False,
    )
    head = getattr(engine.drafter, "head", None)
    if head is None or not hasattr(head, "lm_head"):
        raise ValueError(f"--drafter {drafter!r} has no packed EAGLE head to measure")
    timed = _Timed(engine.drafter)
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True}
    for i in range(rows):
        engine.add_request(prompts[i % len(prompts)], seed=i, **settings)
    while engine.has_unfinished():
        engine.step()
    steady = timed.steps[1:]  # the first drafting step catches up a whole prompt
    catch = timed.catch_up[1:]
    return {
        "rows": rows,
        "depth": depth,
        "temperature": temperature,
        "steps": len(steady),
        "draft_ms": 1e3 * statistics.median(steady),
        "catch_up_ms": 1e3 * statistics.median(catch),
        "head_bytes": head_bytes(head),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m specdec.bench.draft_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument(
        "--drafter", default="eagle", help="a drafter with an EAGLE head (eagle, ngram-eagle, ...)"
    )
    p.add_argument("--rows", type=csv(positive_int), default=(1, 8))
    p.add_argument("--depth", type=positive_int, default=3)
    p.add_argument("--temperature", type=finite_float, default=0.8, help="the sampled runs' temperature")
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write draft-floor.json and draft-floor.md here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import specdec
    from specdec.bench.target import read_bandwidth
    from specdec.prompt_sets import encode_prompt, load_prompts

    target = specdec.load_target(args.target)
    texts = load_prompts("humaneval", args.num_prompts // 2) + load_prompts(
        "mtbench", args.num_prompts - args.num_prompts // 2
    )
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in texts]
    env = environment()
    print(machine_line(env) + f", commit {env['commit']}", file=sys.stderr)
    levels = []
    for rows in args.rows:
        for temperature in (0.0, args.temperature):
            level = measure_level(
                target, prompts, drafter=args.drafter, rows=rows, depth=args.depth,
                temperature=temperature, max_new_tokens=args.max_new_tokens,
            )  # fmt: skip
            levels.append(level)
            print(f"G={rows} T={temperature:g}: {level['draft_ms']:.2f} ms/step", file=sys.stderr)
    bytes_ = levels[0]["head_bytes"]  # the same head at every level
    for lv in levels:
        del lv["head_bytes"]
    bandwidth = read_bandwidth()
    K = args.depth
    floor_ms = 1e3 * (K * (bytes_["layer"] + bytes_["lm_head"]) + bytes_["aux"]) / bandwidth
    greedy = {lv["rows"]: lv["draft_ms"] for lv in levels if lv["temperature"] == 0}
    for lv in levels:
        lv["floor_ms"] = floor_ms
        lv["over_floor"] = lv["draft_ms"] / floor_ms
        lv["over_greedy"] = lv["draft_ms"] / greedy[lv["rows"]]
        lv["over_one_row"] = lv["draft_ms"] / next(
            x["draft_ms"]
            for x in levels
            if x["rows"] == min(args.rows) and x["temperature"] == lv["temperature"]
        )
    result = {
        "command": command_line("python -m specdec.bench.draft_floor", argv),
        "environment": env,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "head_bytes": bytes_,
        "levels": levels,
    }
    text = markdown(result)
    print(text)
    if args.out is not None:
        document = benchmark_document(
            result, experiment="draft-floor", summarize=summarize, description=__doc__.split("\n")[0]
        )
        write_results(args.out / "draft-floor.json", document, text)
    return 0


def summarize(result: dict[str, Any]) -> Summary:
    """The results file's table (``specdec.summary/1``)."""
    rows = [
        {**lv, "sampling": "greedy" if lv["temperature"] == 0 else f"T={lv['temperature']:g}"}
        for lv in result["levels"]
    ]
    columns = [
        ("rows", "rows", "d"),
        ("sampling", "sampling", ""),
        ("draft_ms", "drafting ms/step", ".2f"),
        ("catch_up_ms", "catch-up ms", ".2f"),
        ("floor_ms", "floor ms", ".2f"),
        ("over_floor", "$\\times$ floor", ".2f"),
        ("over_greedy", "$\\times$ greedy", ".2f"),
        ("over_one_row", "$\\times$ one row", ".2f"),
    ]
    caption = (
        f"EAGLE drafting per engine step at depth {result['levels'][0]['depth']} against the head's "
        f"weight-streaming floor ({result['read_bandwidth_gb_s']:.1f} GB/s read bandwidth)"
    )
    return Summary(
        title="EAGLE drafting against its floor",
        tables=(table_from_rows("draft-floor", caption, columns, rows),),
    )


def markdown(result: dict[str, Any]) -> str:
    """The result as a Markdown table under its machine line."""
    env = result["environment"]
    b = result["head_bytes"]
    lines = [
        f"{machine_line(env)}, commit {env['commit']}; read bandwidth "
        f"{result['read_bandwidth_gb_s']:.1f} GB/s; head: layer {b['layer'] / 1e6:.2f} MB, "
        f"LM head {b['lm_head'] / 1e6:.2f} MB, aux {b['aux'] / 1e6:.2f} MB",
        "",
        f"`{result['command']}`",
        "",
        "| rows | sampling | drafting ms/step | of it catch-up ms | floor ms | × floor | × greedy "
        "| × one row | steps |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in result["levels"]:
        sampling = "greedy" if lv["temperature"] == 0 else f"T={lv['temperature']:g}"
        lines.append(
            f"| {lv['rows']} | {sampling} | {lv['draft_ms']:.2f} | {lv['catch_up_ms']:.2f} "
            f"| {lv['floor_ms']:.2f} | {lv['over_floor']:.2f} | {lv['over_greedy']:.2f} "
            f"| {lv['over_one_row']:.2f} | {lv['steps']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
