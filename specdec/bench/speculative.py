"""Speed benchmark: our engine per drafter vs plain decoding vs ``transformers`` ``generate``.

    python -m specdec.bench --prompt-set humaneval,mtbench --num-prompts 5 --max-new-tokens 128 \\
        --temperatures 0,0.7 --drafters none,ngram,layerskip,eagle,eagle-tree --out results/bench

Everything runs in one process on the same prompts, so the ratios compare like with like:

- ``ours/<drafter>``: one engine per drafter, the drafter built by its name, one request at a time,
  driven by :func:`specdec.loop.drive` (the driver of ``specdec generate`` and of
  ``specdec bench --concurrency``); ``none`` is our plain decode, the baseline of every speedup.
  Unavailable drafters are skipped with a note;
- ``hf/plain``, ``hf/prompt_lookup`` (``prompt_lookup_num_tokens=γ``) and ``hf/assistant``
  (``assistant_model``, when ``--draft-model`` is given): ``transformers``' own ``generate``.

Per prompt set and temperature it reports tok/s, speedup over our plain decode, α, τ, the speedup
the cost model predicts from the run's own α and measured draft / verify costs
(:func:`specdec.metrics.predicted_speedup_from_metrics`), the measured / predicted ratio, and for
greedy runs the exact-match rate against our plain decode (token for token). Results go to
``<out>/bench.json`` and ``<out>/bench.md`` (:mod:`specdec.bench.report`), rewritten after every
prompt: methods run interleaved, each prompt through every method before the next, so an
interrupted benchmark keeps every finished prompt and machine drift hits all methods alike. A method
that raises is dropped from that temperature's results with a note (the error, the prompt), and the
others go on; only a failure of plain decoding, the baseline of every ratio, ends the run.
``--device cuda`` puts the target, a model drafter and transformers' models on a GPU.
``--drafter-gamma LABEL=N`` gives one drafter label its own γ (with ``LABEL=DRAFTER`` labels, one run
compares draft lengths of one drafter side by side). ``--gamma-policy`` (default ``auto``, as
``specdec generate`` and the engine: each step's depth in 0..γ from the measured verify cost and
the request's acceptance) takes ``fixed`` for drafting exactly γ every step.

Prompts (:mod:`specdec.prompt_sets`): HumanEval and the first turn of the 80 MT-Bench questions,
read as data files; ``--num-prompts`` takes that many per set, evenly spaced.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.hf_baselines import HF_BASELINES, hf_method
from specdec.bench.interleave import Prompt, engine_method, method_engine, run_interleaved
from specdec.bench.llama_bench import comparison_markdown, run_llama_bench
from specdec.bench.peers import PEERS, llama_cpp_methods
from specdec.bench.report import (
    bench_document,
    environment,
    llama_bench_rows,
    markdown_table,
    pooled_tokens_per_second,
    serialise_run,
    summarize,
    write_results,
)
from specdec.cli_args import (
    ArgumentParser,
    add_engine_arguments,
    csv,
    finite_float,
    positive_int,
    seed_int,
    stderr_line,
)
from specdec.prompt_sets import (
    CHAT_PROMPT_SETS,
    PROMPT_SETS,
    encode_prompt,
    load_prompts,
)
from specdec.seeds import check_seed
from specdec.summary import check_experiment_name, utc_now

__all__ = [
    "BenchConfig",
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
    peers: tuple[str, ...] = ()
    """Other engines on the same prompts: ``llama.cpp`` (llama-cpp-python on the target's GGUF file,
    plain and with prompt lookup; ``llama-bench``'s figures when it is at ``$LLAMA_BENCH`` or on PATH)."""
    gamma: int = 4
    drafter_gammas: dict[str, int] = field(default_factory=dict)
    """γ for some drafter labels (others use ``gamma``), so one interleaved run compares draft
    lengths: ``drafters=("ngram-eagle", "ne-g6=ngram-eagle")``, ``drafter_gammas={"ne-g6": 6}``."""
    gamma_policy: str = "auto"
    draft_model: str | None = None
    drafter_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    chat: bool = False
    seed: int = 0
    dtype: str | None = None
    weights: str | None = None
    """The native target's weight format (``fp32``, ``bf16``, ``gguf``, ``int8``, ``int4``); None:
    the target's default."""
    backend: str = "auto"
    device: str = "cpu"
    compile: str | None = None
    """The native target's captured forwards (``specdec.targets.compiled.COMPILE_MODES``); None: eager."""
    warmup: bool = True
    out: str = "results/bench"
    name: str = "specdec-bench"
    """The results' experiment name (``bench.json`` is a ``specdec.summary/1`` file: the paper's table
    labels and a published file's name come from it)."""

    def __post_init__(self) -> None:
        check_experiment_name(self.name, "name")
        check_seed(self.seed)
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
        if not self.temperatures or any(
            not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0) for t in self.temperatures
        ):
            raise ValueError(
                f"temperatures must be a non-empty list of numbers >= 0, got {self.temperatures}"
            )
        for s in self.prompt_sets:
            if s not in PROMPT_SETS:
                raise ValueError(f"unknown prompt set {s!r}; known: {', '.join(PROMPT_SETS)}")
        for b in self.hf_baselines:
            if b not in HF_BASELINES:
                raise ValueError(f"unknown transformers baseline {b!r}; known: {', '.join(HF_BASELINES)}")
        for peer in self.peers:
            if peer not in PEERS:
                raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")


def _label_and_drafter(entry: str) -> tuple[str, str]:
    """``"LABEL=DRAFTER"`` → (label, registered drafter); a bare ``"DRAFTER"`` is its own label."""
    label, _, name = entry.rpartition("=")
    return label or name, name


# --- the benchmark ------------------------------------------------------------------------------------


def _prompts(cfg: BenchConfig, tokenizer: Any) -> list[Prompt]:
    return [
        Prompt(set_name, i, encode_prompt(tokenizer, text, chat=cfg.chat or set_name in CHAT_PROMPT_SETS))
        for set_name in cfg.prompt_sets
        for i, text in enumerate(load_prompts(set_name, cfg.num_prompts))
    ]


def _engines(cfg: BenchConfig, target: Any, prompts: list[Prompt], notes: list[str]) -> dict[str, Any]:
    """One engine per drafter label (``none`` first), its drafter built by name
    (:func:`specdec.bench.interleave.method_engine`: what ``specdec generate`` and ``specdec serve``
    run), serving every prompt and temperature one request at a time; unavailable drafters are skipped
    with a note."""
    from specdec.engine.depth import make_depth_policy
    from specdec.registry import DRAFTERS
    from specdec.targets import open_target

    longest = max(len(p.ids) for p in prompts)
    engines: dict[str, Any] = {}
    for entry in ("none", *cfg.drafters):
        # "LABEL=DRAFTER" runs a registered drafter under its own label, with the options given for
        # that label, so one run can compare settings of one drafter (eagle,eagle-stop=eagle).
        label, name = _label_and_drafter(entry)
        if label in engines:
            continue
        if name not in DRAFTERS:
            notes.append(f"ours/{label} skipped: not registered (known: {', '.join(DRAFTERS.names())})")
            continue
        options = dict(cfg.drafter_options.get(label, {}))
        if DRAFTERS.resolve(name) == "model" and "model" not in options:
            if not cfg.draft_model:
                notes.append("ours/model skipped: no --draft-model given")
                continue
            options["model"] = open_target(
                cfg.draft_model, backend=cfg.backend, dtype=cfg.dtype, device=cfg.device
            )
        gamma = cfg.drafter_gammas.get(label, cfg.gamma)
        try:
            engines[label] = method_engine(
                target,
                name,
                drafter_options=options,
                gamma=make_depth_policy(cfg.gamma_policy, {"gamma": gamma}),
                max_model_len=longest + cfg.max_new_tokens + gamma + 1,
            )
        except (ImportError, ValueError, NotImplementedError) as e:
            if label == "none":
                raise
            notes.append(f"ours/{label} skipped: {type(e).__name__}: {e}")
    return engines


def _peer_methods(cfg: BenchConfig, target: Any, temperature: float, notes: list[str]) -> dict:
    """llama.cpp's methods on the target's GGUF file (skipped with a note where it cannot run)."""
    if "llama.cpp" not in cfg.peers:
        return {}
    import torch

    from specdec.targets.loading import gguf_source

    gguf = gguf_source(cfg.target)
    if gguf is None:
        notes.append(f"llama.cpp skipped: the target {cfg.target!r} does not come as a GGUF file")
        return {}
    try:
        return llama_cpp_methods(
            gguf, threads=torch.get_num_threads(), temperature=temperature, eos_token_ids=target.eos_token_ids
        )
    except ImportError:
        notes.append('llama.cpp skipped: llama-cpp-python is not installed (pip install -e ".[peers]")')
        return {}


def _methods(
    cfg: BenchConfig, target: Any, engines: dict, hf: tuple, temperature: float, notes: list
) -> dict:
    """Every method of one temperature: ours/none first (the baseline), transformers', peers',
    ours/<drafter>."""

    def ours(label: str) -> Callable:
        return engine_method(engines[label], temperature=temperature)

    hf_model, assistant = hf
    methods = {"ours/none": ours("none")}
    for mode in cfg.hf_baselines:
        if mode != "assistant" or assistant is not None:
            methods[f"hf/{mode}"] = hf_method(hf_model, mode, temperature, cfg.gamma, assistant)
    methods.update(_peer_methods(cfg, target, temperature, notes))
    methods.update({f"ours/{label}": ours(label) for label in engines if label != "none"})
    return methods


class _Recorder:
    """The results so far, written to ``bench.json`` / ``bench.md`` after every prompt."""

    def __init__(
        self, cfg: BenchConfig, command: str, notes: list[str], console: Any, num_prompts: int
    ) -> None:
        self.cfg, self.command, self.notes, self.console = cfg, command, notes, console
        self.num_prompts, self.runs, self.done = num_prompts, [], 0
        self.created_at = utc_now()
        self.payload: dict[str, Any] = {
            "config": asdict(cfg),
            "command": command,
            "environment": environment(),
            "notes": notes,
            "summary": [],
            "runs": [],
        }

    def temperature_runs(self, temperature: float, results: dict[str, list]) -> list[dict]:
        return [{"method": m, "temperature": temperature, "results": r} for m, r in results.items()]

    def prompt_done(self, temperature: float, results: dict[str, list]) -> None:
        self.done += 1
        self.console.print(f"T={temperature:g}: {self.done}/{self.num_prompts} prompts through every method")
        current = self.runs + self.temperature_runs(temperature, results)
        self.payload["summary"] = summarize(current, self.cfg.prompt_sets)
        self.payload["runs"] = [serialise_run(r) for r in current]
        finished = self.cfg.temperatures.index(temperature) + (self.done == self.num_prompts)
        document = bench_document(
            self.payload, self.cfg.name, complete_temperatures=finished, created_at=self.created_at
        )
        write_results(Path(self.cfg.out), {**document, **self.payload}, self.command)

    def failed(self, temperature: float, method: str, prompt: Prompt, err: Exception) -> None:
        where = f"{method} T={temperature:g} failed at prompt {prompt.set}/{prompt.index}"
        note = f"{where}: {type(err).__name__}: {err}"
        self.notes.append(note[:1000])
        self.console.print(f"[red]error:[/] {note[:300]}")

    def finish(self, temperature: float, results: dict[str, list]) -> None:
        self.done = 0
        self.runs += self.temperature_runs(temperature, results)
        for m, r in results.items():
            self.console.print(f"{m} T={temperature:g}: {pooled_tokens_per_second(r):.1f} tok/s")


def run_bench(cfg: BenchConfig, *, command: str = "", console=None) -> dict:
    """Run every method on the same prompts, interleaved; write the results after every prompt (an
    interrupted run keeps every finished prompt) and return them."""
    from rich.console import Console

    from specdec.targets import open_target_from

    console = console or Console(stderr=True)
    notes: list[str] = []
    target = open_target_from(cfg)
    prompts = _prompts(cfg, target.tokenizer)
    hf = _hf_models(cfg, target, notes)
    engines = _engines(cfg, target, prompts, notes)
    for n in notes:
        console.print(f"[yellow]note:[/] {n}")
    recorder = _Recorder(cfg, command, notes, console, len(prompts))
    recorder.payload["environment"].update(_target_facts(target))
    if "llama.cpp" in cfg.peers:
        from specdec.targets.loading import gguf_source

        figures = run_llama_bench(gguf_source(cfg.target), threads=torch_threads())
        recorder.payload["llama_bench"] = figures
        if isinstance(figures, str):
            notes.append(figures)
            console.print(f"[yellow]note:[/] {figures}")
    for t in cfg.temperatures:
        results = run_interleaved(
            _methods(cfg, target, engines, hf, t, notes),
            prompts,
            max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed,
            warmup=cfg.warmup,
            baseline="ours/none",
            on_error=lambda m, p, e, t=t: recorder.failed(t, m, p, e),
            on_prompt_done=lambda r, t=t: recorder.prompt_done(t, r),
        )
        recorder.finish(t, results)
    return recorder.payload


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _target_facts(target: Any) -> dict[str, Any]:
    """What the header names besides the machine: the target's weight format and size."""
    return {
        "target_class": type(target).__name__,
        "weights": getattr(target, "weights", None),
        "weight_bytes": getattr(target, "weight_bytes", None),
    }


def _hf_models(cfg: BenchConfig, target: Any, notes: list[str]) -> tuple[Any, Any]:
    """transformers' model of the target (and the assistant model) when a baseline needs them."""
    if not cfg.hf_baselines:
        return None, None
    import torch

    from specdec.targets.loading import load_hf_model

    dtype = getattr(torch, cfg.dtype) if cfg.dtype else torch.float32
    hf_model = getattr(target, "model", None)
    if hf_model is None or not hasattr(hf_model, "generate"):
        hf_model = load_hf_model(cfg.target, dtype=dtype).to(cfg.device)
    assistant = None
    if "assistant" in cfg.hf_baselines:
        if cfg.draft_model:
            assistant = load_hf_model(cfg.draft_model, dtype=dtype).to(cfg.device)
        else:
            notes.append("hf/assistant skipped: no --draft-model given")
    return hf_model, assistant


# --- command line -------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``specdec bench`` and ``python -m specdec.bench``)."""
    d = BenchConfig()
    add_engine_arguments(p, drafter="per-label", gamma_default=d.gamma, verify=False)
    p.set_defaults(device=d.device)  # every model of the bench: the target, a model drafter, transformers'
    p.add_argument(
        "--prompt-set", type=csv(str), default=d.prompt_sets, help="humaneval,mtbench,mtbench-chat"
    )
    p.add_argument(
        "--num-prompts", type=positive_int, default=d.num_prompts, help="prompts per set (evenly spaced)"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=d.max_new_tokens)
    p.add_argument("--temperatures", type=csv(finite_float), default=d.temperatures, help="e.g. 0,0.7")
    p.add_argument(
        "--drafters",
        type=csv(str),
        default=d.drafters,
        help="ours: none,ngram,layerskip,model,eagle,... (LABEL=DRAFTER runs a drafter under a label "
        "that takes its own --drafter-option LABEL.KEY=VALUE)",
    )
    p.add_argument(
        "--hf-baselines",
        type=csv(str),
        default=d.hf_baselines,
        help="transformers generate: plain,prompt_lookup,assistant (empty string: none)",
    )
    p.add_argument(
        "--drafter-gamma",
        action="append",
        metavar="LABEL=N",
        help="γ for one drafter label (repeatable); with LABEL=DRAFTER one run compares draft lengths",
    )
    p.add_argument("--draft-model", default=None, help="checkpoint for ours/model and hf/assistant")
    p.add_argument("--chat", action="store_true", help="wrap every prompt in the chat template")
    p.add_argument("--seed", type=seed_int, default=d.seed)
    p.add_argument(
        "--peers",
        type=csv(str),
        default=d.peers,
        help="other engines on the same prompts: llama.cpp (needs .[peers])",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation per run")
    p.add_argument("--out", default=d.out, help="output folder for bench.json and bench.md")
    p.add_argument("--name", default=d.name, help="experiment name of the results (schema specdec.summary/1)")
    p.add_argument(
        "--concurrency",
        type=csv(positive_int),
        default=None,
        help="e.g. 1,2,4,8: the engine under load, every drafter against none (specdec.bench.concurrency)",
    )
    p.set_defaults(func=cmd_bench)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A :class:`BenchConfig` from parsed arguments."""
    from specdec.cli_args import config_from_args, parse_options

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
    return config_from_args(
        BenchConfig,
        args,
        prompt_sets=args.prompt_set,
        drafter_gammas=gammas,
        drafter_options=per_drafter,
        warmup=not args.no_warmup,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    if getattr(args, "concurrency", None):
        from rich.console import Console

        from specdec.bench.concurrency import from_bench_args, run_concurrency

        run_concurrency(from_bench_args(args), Console(stderr=True))
        out = Path(args.out)
        print(f"results: {out / 'concurrency.json'}, {out / 'concurrency.md'}", file=sys.stderr)
        return 0
    cfg = config_from_args(args)
    command = (
        "python -m specdec.bench " + " ".join(sys.argv[1:])
        if args.command is None
        else ("specdec " + " ".join(sys.argv[1:]))
    )
    payload = run_bench(cfg, command=command)
    print(markdown_table(payload["summary"]))
    if payload.get("llama_bench"):
        print(comparison_markdown(payload["llama_bench"], llama_bench_rows(payload)))
    for note in payload["notes"]:
        print(f"note: {note}")
    print(f"results: {Path(cfg.out) / 'bench.json'}, {Path(cfg.out) / 'bench.md'}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specdec.bench``."""
    parser = ArgumentParser(prog="python -m specdec.bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(command=None)
    args = parser.parse_args(argv)
    try:
        return cmd_bench(args)
    except ValueError as e:
        stderr_line("specdec bench", e)
        return 2
