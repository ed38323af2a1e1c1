"""Speed benchmark: our decode loop per drafter vs plain decoding vs ``transformers`` ``generate``.

    python -m specdec.bench --prompt-set humaneval,mtbench --num-prompts 5 --max-new-tokens 128 \\
        --temperatures 0,0.7 --drafters none,ngram,layerskip,eagle,eagle-tree --out results/bench

Everything runs in one process on the same prompts, so the ratios compare like with like:

- ``ours/<drafter>``: :func:`specdec.generate` with each drafter (``none`` is our plain decode, the
  baseline of every speedup); unavailable drafters are skipped with a note;
- ``hf/plain``, ``hf/prompt_lookup`` (``prompt_lookup_num_tokens=γ``) and ``hf/assistant``
  (``assistant_model``, when ``--draft-model`` is given): ``transformers``' own ``generate``.

Per prompt set and temperature it reports tok/s, speedup over our plain decode, α, τ, the speedup
the cost model predicts from the run's own α and measured draft / verify costs
(:func:`specdec.metrics.predicted_speedup_from_metrics`), the measured / predicted ratio, and for
greedy runs the exact-match rate against our plain decode (token for token). Results go to
``<out>/bench.json`` and ``<out>/bench.md`` (:mod:`specdec.bench_report`), rewritten after every
prompt: methods run interleaved, each prompt through every method before the next, so an
interrupted benchmark keeps every finished prompt and machine drift hits all methods alike. A method
that raises is dropped from that temperature's results with a note (the error, the prompt), and the
others go on; only a failure of plain decoding, the baseline of every ratio, ends the run.
``--device cuda`` puts the target, a model drafter and transformers' models on a GPU.
``--drafter-gamma LABEL=N`` gives one drafter label its own γ (with ``LABEL=DRAFTER`` labels, one run
compares draft lengths of one drafter side by side).

Prompts (:mod:`specdec.prompt_sets`): HumanEval and the first turn of the 80 MT-Bench questions,
read as data files; ``--num-prompts`` takes that many per set, evenly spaced.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench_report import (
    PromptResult,
    environment,
    markdown_table,
    pooled_tokens_per_second,
    serialise_run,
    summarize,
    write_results,
)
from specdec.prompt_sets import (
    CHAT_PROMPT_SETS,
    PROMPT_SETS,
    humaneval_prompts,
    load_prompts,
    mtbench_prompts,
    mtbench_questions,
)

__all__ = [
    "BenchConfig",
    "PROMPT_SETS",
    "PromptResult",
    "humaneval_prompts",
    "load_prompts",
    "markdown_table",
    "mtbench_prompts",
    "mtbench_questions",
    "summarize",
    "run_bench",
    "add_arguments",
    "main",
]


# --- configuration ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One benchmark invocation."""

    target: str = "smollm2-135m"
    prompt_sets: tuple[str, ...] = ("humaneval", "mtbench")
    num_prompts: int = 5
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 0.7)
    drafters: tuple[str, ...] = ("none", "ngram", "layerskip", "model", "eagle", "eagle-tree")
    hf_baselines: tuple[str, ...] = ("plain", "prompt_lookup", "assistant")
    gamma: int = 4
    drafter_gammas: dict[str, int] = field(default_factory=dict)
    """γ for some drafter labels (others use ``gamma``), so one interleaved run compares draft
    lengths: ``drafters=("ngram-eagle", "ne-g6=ngram-eagle")``, ``drafter_gammas={"ne-g6": 6}``."""
    gamma_policy: str = "fixed"
    draft_model: str | None = None
    drafter_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    chat: bool = False
    seed: int = 0
    dtype: str | None = None
    backend: str = "auto"
    device: str = "cpu"
    warmup: bool = True
    out: str = "results/bench"

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")
        labels = {_label_and_drafter(entry)[0] for entry in self.drafters}
        for label, g in self.drafter_gammas.items():
            if label not in labels:
                raise ValueError(
                    f"drafter_gammas names {label!r}, which is not a drafter label of this run "
                    f"({', '.join(sorted(labels))})"
                )
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                raise ValueError(f"drafter_gammas[{label!r}] must be an int >= 0, got {g!r}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(
                f"temperatures must be a non-empty list of numbers >= 0, got {self.temperatures}"
            )
        for s in self.prompt_sets:
            if s not in PROMPT_SETS:
                raise ValueError(f"unknown prompt set {s!r}; known: {', '.join(PROMPT_SETS)}")
        for b in self.hf_baselines:
            if b not in HF_BASELINES:
                raise ValueError(f"unknown transformers baseline {b!r}; known: {', '.join(HF_BASELINES)}")


def _label_and_drafter(entry: str) -> tuple[str, str]:
    """``"LABEL=DRAFTER"`` → (label, registered drafter); a bare ``"DRAFTER"`` is its own label."""
    label, _, name = entry.rpartition("=")
    return label or name, name


@dataclass
class Prompt:
    set: str
    index: int
    ids: list[int]


# --- runners ------------------------------------------------------------------------------------------


def _run_ours(
    target,
    prompts: list[Prompt],
    drafter,
    temperature: float,
    cfg: BenchConfig,
    tick,
    warmup: bool = True,
    gamma: int | None = None,
) -> list[PromptResult]:
    import specdec
    from specdec.policies import make_policy

    gamma = cfg.gamma if gamma is None else gamma
    policy = make_policy(cfg.gamma_policy, gamma=gamma)
    if cfg.warmup and warmup:
        specdec.generate(
            target,
            [prompts[0].ids],
            drafter=drafter,
            max_new_tokens=min(8, cfg.max_new_tokens),
            temperature=temperature,
            gamma=make_policy(cfg.gamma_policy, gamma=gamma),
            seed=cfg.seed,
        )
    results = []
    for p in prompts:
        out = specdec.generate(
            target,
            [p.ids],
            drafter=drafter,
            max_new_tokens=cfg.max_new_tokens,
            temperature=temperature,
            gamma=policy,
            seed=cfg.seed + p.index,
        )
        m = out.metrics
        results.append(PromptResult(p.set, p.index, out.token_ids[0], m.total_time_s, m))
        tick()
    return results


def _hf_generate_kwargs(mode: str, temperature: float, cfg: BenchConfig, assistant) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        # transformers would otherwise add its default top_k=50; ours samples the full distribution.
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    if mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = cfg.gamma
    elif mode == "assistant":
        assistant.generation_config.num_assistant_tokens = cfg.gamma
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = assistant
    return kwargs


HF_BASELINES = ("plain", "prompt_lookup", "assistant")


def _run_hf(
    model,
    prompts: list[Prompt],
    mode: str,
    temperature: float,
    cfg: BenchConfig,
    assistant,
    tick,
    warmup: bool = True,
):
    import torch

    kwargs = _hf_generate_kwargs(mode, temperature, cfg, assistant)
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
    kwargs["pad_token_id"] = pad

    def one(ids: list[int], max_new: int, seed: int) -> tuple[list[int], float]:
        x = torch.tensor([ids], device=model.device)
        torch.manual_seed(seed)
        sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = model.generate(x, attention_mask=torch.ones_like(x), **{**kwargs, "max_new_tokens": max_new})
        sync()
        return y[0, len(ids) :].tolist(), time.perf_counter() - t0

    if cfg.warmup and warmup:
        one(prompts[0].ids, min(8, cfg.max_new_tokens), cfg.seed)
    results = []
    for p in prompts:
        ids, dt = one(p.ids, cfg.max_new_tokens, cfg.seed + p.index)
        results.append(PromptResult(p.set, p.index, ids, dt))
        tick()
    return results


# --- the benchmark ------------------------------------------------------------------------------------


def run_bench(cfg: BenchConfig, *, command: str = "", console=None) -> dict:
    """Run every method on the same prompts; write and return the results."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specdec.cli import encode_prompt, open_target, target_tokenizer
    from specdec.registry import DRAFTERS, create_drafter

    console = console or Console(stderr=True)
    notes: list[str] = []
    target = open_target(cfg.target, backend=cfg.backend, dtype=cfg.dtype, device=cfg.device)
    tokenizer = target_tokenizer(target, cfg.target)
    prompts = [
        Prompt(set_name, i, encode_prompt(tokenizer, text, chat=cfg.chat or set_name in CHAT_PROMPT_SETS))
        for set_name in cfg.prompt_sets
        for i, text in enumerate(load_prompts(set_name, cfg.num_prompts))
    ]

    hf_model = assistant = None
    if cfg.hf_baselines:
        import torch

        from specdec.targets.loading import load_hf_model

        dtype = getattr(torch, cfg.dtype) if cfg.dtype else torch.float32
        hf_model = getattr(target, "model", None)
        if hf_model is None or not hasattr(hf_model, "generate"):
            hf_model = load_hf_model(cfg.target, dtype=dtype).to(cfg.device)
        if "assistant" in cfg.hf_baselines:
            if cfg.draft_model:
                assistant = load_hf_model(cfg.draft_model, dtype=dtype).to(cfg.device)
            else:
                notes.append("hf/assistant skipped: no --draft-model given")

    drafters: dict[str, Any] = {}
    for entry in cfg.drafters:
        # "LABEL=DRAFTER" runs a registered drafter under its own label, with the options given for
        # that label, so one run can compare settings of one drafter (eagle,eagle-stop=eagle).
        label, name = _label_and_drafter(entry)
        if name not in DRAFTERS:
            notes.append(f"ours/{label} skipped: not registered (known: {', '.join(DRAFTERS.names())})")
            continue
        options = dict(cfg.drafter_options.get(label, {}))
        if DRAFTERS.resolve(name) == "model":
            if not cfg.draft_model and "model" not in options:
                notes.append("ours/model skipped: no --draft-model given")
                continue
            if "model" not in options:
                options["model"] = open_target(
                    cfg.draft_model, backend=cfg.backend, dtype=cfg.dtype, device=cfg.device
                )
        try:
            drafters[label] = create_drafter(name, target, **options)
        except (ImportError, ValueError, NotImplementedError) as e:
            notes.append(f"ours/{label} skipped: {type(e).__name__}: {e}")
    if "none" not in drafters:
        drafters = {"none": create_drafter("none", target), **drafters}

    plan: list[tuple[str, float, Callable]] = []
    for temperature in cfg.temperatures:
        plan.append(
            (
                "ours/none",
                temperature,
                lambda T, tick, ps, w: _run_ours(target, ps, drafters["none"], T, cfg, tick, w),
            )
        )
        for mode in cfg.hf_baselines:
            if mode == "assistant" and assistant is None:
                continue
            plan.append(
                (
                    f"hf/{mode}",
                    temperature,
                    lambda T, tick, ps, w, mode=mode: _run_hf(hf_model, ps, mode, T, cfg, assistant, tick, w),
                )
            )
        for name, drafter in drafters.items():
            if name != "none":
                plan.append(
                    (
                        f"ours/{name}",
                        temperature,
                        lambda T, tick, ps, w, d=drafter, name=name: _run_ours(
                            target, ps, d, T, cfg, tick, w, cfg.drafter_gammas.get(name)
                        ),
                    )
                )

    for n in notes:
        console.print(f"[yellow]note:[/] {n}")
    runs: list[dict] = []
    payload: dict[str, Any] = {
        "config": asdict(cfg),
        "command": command,
        "environment": environment(),
        "notes": notes,
        "summary": [],
        "runs": [],
    }
    out_dir = Path(cfg.out)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # Interleaved: per temperature, every method warms up once, then each prompt runs through every
    # method before the next prompt starts (the order rotates per prompt), so slow drifts of a
    # shared machine hit all methods alike and the ratios stay side by side.
    with Progress(*columns, console=console) as progress:
        overall = progress.add_task("all runs", total=len(plan) * len(prompts))
        for temperature in cfg.temperatures:
            group = [(m, fn) for m, t, fn in plan if t == temperature]
            results: dict[str, list] = {m: [] for m, _ in group}
            for m, _ in group:
                runs.append({"method": m, "temperature": temperature, "results": results[m]})
            task = progress.add_task(f"T={temperature:g}", total=len(group) * len(prompts))

            def tick(task=task) -> None:
                progress.advance(task)
                progress.advance(overall)

            failed: set[str] = set()
            for i, p in enumerate(prompts):
                shift = i % len(group)
                for m, fn in group[shift:] + group[:shift]:
                    if m in failed:
                        tick()
                        continue
                    try:
                        results[m].extend(fn(temperature, tick, [p], i == 0))
                    except Exception as e:  # one broken method must not cost the others' results
                        if m == "ours/none":
                            raise  # the baseline of every speedup
                        failed.add(m)  # its partial results would compare unlike prompt sets: dropped
                        runs[:] = [
                            r for r in runs if not (r["method"] == m and r["temperature"] == temperature)
                        ]
                        where = f"{m} T={temperature:g} failed at prompt {p.set}/{p.index}"
                        note = f"{where}: {type(e).__name__}: {e}"
                        notes.append(note[:1000])
                        console.print(f"[red]error:[/] {note[:300]}")
                        tick()
                payload["summary"] = summarize(runs, cfg.prompt_sets)
                payload["runs"] = [serialise_run(r) for r in runs]
                write_results(out_dir, payload, command)
            progress.remove_task(task)
            for m, _ in group:
                console.print(f"{m} T={temperature:g}: {pooled_tokens_per_second(results[m]):.1f} tok/s")
    return payload


# --- command line -------------------------------------------------------------------------------------


def _csv(cast: Callable[[str], Any]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        return tuple(cast(x.strip()) for x in text.split(",") if x.strip())

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``specdec bench`` and ``python -m specdec.bench``)."""
    d = BenchConfig()
    p.add_argument("--target", default=d.target)
    p.add_argument(
        "--prompt-set", type=_csv(str), default=d.prompt_sets, help="humaneval,mtbench,mtbench-chat"
    )
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="prompts per set (evenly spaced)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperatures", type=_csv(float), default=d.temperatures, help="e.g. 0,0.7")
    p.add_argument(
        "--drafters",
        type=_csv(str),
        default=d.drafters,
        help="ours: none,ngram,layerskip,model,eagle,... (LABEL=DRAFTER runs a drafter under a label "
        "that takes its own --drafter-option LABEL.KEY=VALUE)",
    )
    p.add_argument(
        "--hf-baselines",
        type=_csv(str),
        default=d.hf_baselines,
        help="transformers generate: plain,prompt_lookup,assistant (empty string: none)",
    )
    p.add_argument("--gamma", type=int, default=d.gamma)
    p.add_argument(
        "--drafter-gamma",
        action="append",
        metavar="LABEL=N",
        help="γ for one drafter label (repeatable); with LABEL=DRAFTER one run compares draft lengths",
    )
    p.add_argument("--gamma-policy", default=d.gamma_policy, help="fixed | heuristic | cost")
    p.add_argument("--draft-model", default=None, help="checkpoint for ours/model and hf/assistant")
    p.add_argument(
        "--drafter-option",
        action="append",
        metavar="DRAFTER.KEY=VALUE",
        help="option for one drafter, e.g. layerskip.num_layers=8 (repeatable)",
    )
    p.add_argument("--chat", action="store_true", help="wrap every prompt in the chat template")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--backend", default=d.backend, help="target backend: auto | hf | llama")
    p.add_argument("--device", default=d.device, help="torch device for every model: cpu, cuda, cuda:1, ...")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation per run")
    p.add_argument("--out", default=d.out, help="output folder for bench.json and bench.md")
    p.set_defaults(func=cmd_bench)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A :class:`BenchConfig` from parsed arguments."""
    from specdec.cli import parse_options

    per_drafter: dict[str, dict[str, Any]] = {}
    for item in args.drafter_option or ():
        name, dot, rest = item.partition(".")
        if not dot:
            raise ValueError(f"--drafter-option expects DRAFTER.KEY=VALUE, got {item!r}")
        per_drafter.setdefault(name, {}).update(parse_options([rest], "--drafter-option"))
    gammas: dict[str, int] = {}
    for item in args.drafter_gamma or ():
        label, eq, value = item.partition("=")
        if not eq or not label or not value.strip().isdigit():
            raise ValueError(f"--drafter-gamma expects LABEL=N with an int N >= 0, got {item!r}")
        gammas[label] = int(value)
    return BenchConfig(
        target=args.target,
        prompt_sets=args.prompt_set,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperatures=args.temperatures,
        drafters=args.drafters,
        hf_baselines=args.hf_baselines,
        gamma=args.gamma,
        drafter_gammas=gammas,
        gamma_policy=args.gamma_policy,
        draft_model=args.draft_model,
        drafter_options=per_drafter,
        chat=args.chat,
        seed=args.seed,
        dtype=args.dtype,
        backend=args.backend,
        device=args.device,
        warmup=not args.no_warmup,
        out=args.out,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    command = (
        "python -m specdec.bench " + " ".join(sys.argv[1:])
        if args.command is None
        else ("specdec " + " ".join(sys.argv[1:]))
    )
    payload = run_bench(cfg, command=command)
    print(markdown_table(payload["summary"]))
    for note in payload["notes"]:
        print(f"note: {note}")
    print(f"results: {Path(cfg.out) / 'bench.json'}, {Path(cfg.out) / 'bench.md'}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specdec.bench``."""
    parser = argparse.ArgumentParser(prog="python -m specdec.bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(command=None)
    args = parser.parse_args(argv)
    try:
        return cmd_bench(args)
    except ValueError as e:
        print(f"specdec bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
