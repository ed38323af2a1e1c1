"""``specdec bench-serve``: a load generator for OpenAI-compatible servers, ours and llama.cpp's.

    specdec bench-serve --servers ours:none,ours:default,llama-server --concurrency 1,2,4,8 \\
        --prompt-set humaneval,mtbench --num-prompts 8 --max-tokens 128 --out DIR
    specdec bench-serve --concurrency 1,4 --endpoint chat --prompt-set mtbench-chat --gamma 3 \\
        --servers ours:none,ours:default,llama-server,llama-server:ngram-mod,llama-server:eagle3
    specdec bench-serve --base-url http://127.0.0.1:8000 --request-rate 0.5,1,2 --burstiness 1 \\
        --goodput ttft:1000 tpot:50

Before any server starts, the head ``llama-server:eagle3`` drafts with is exported and converted
(:mod:`~specdec.bench.serve_heads`; once, then cached). For every server, one after another (started
here for ``ours:DRAFTER`` and ``llama-server[:MODE]``, with the same threads and slots:
:mod:`~specdec.bench.serve_peers`), one warm-up request, then every load level on the same prompts:
the closed-loop ``--concurrency`` levels, then the open-loop ``--request-rate`` levels
(:mod:`~specdec.bench.serve_load`), each between two reads of the server's ``/metrics``. The figures,
table and plots: :mod:`~specdec.bench.serve_report`; the JSON and Markdown files are written after
every level, the plots at the end. The requests of a schema set (``--prompt-set json``:
:mod:`~specdec.bench.json_prompts`) carry their JSON schema as ``response_format``, and every level's
outputs to them are checked against it. The command line: :mod:`~specdec.bench.serve_cli`.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BenchServeConfig", "run_bench_serve"]


@dataclass(frozen=True, kw_only=True)
class BenchServeConfig:
    """Everything ``specdec bench-serve`` takes (see ``specdec bench-serve --help``)."""

    base_url: str | None = None
    servers: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    target: str = "smollm2-135m"
    model: str | None = None
    endpoint: str = "completions"
    prompt_sets: tuple[str, ...] = ("humaneval", "mtbench")
    num_prompts: int = 8
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    concurrency: tuple[int, ...] = ()
    request_rates: tuple[float, ...] = ()
    burstiness: float = 1.0
    goodput: tuple[str, ...] = ()
    threads: int = 2
    max_num_seqs: int | None = None
    gamma: str = "auto"
    llama_head: str | None = None
    llama_convert: str | None = None
    warmup_requests: int = 1
    request_timeout_s: float = 600.0
    startup_timeout_s: float = 600.0
    api_key: str | None = None
    out: str = "results/bench-serve"
    goodput_ms: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        from specdec.bench.json_prompts import SCHEMA_PROMPT_SETS
        from specdec.bench.serve_load import ENDPOINTS
        from specdec.bench.serve_peers import parse_servers
        from specdec.bench.serve_report import parse_goodput
        from specdec.prompt_sets import CHAT_PROMPT_SETS, PROMPT_SETS

        object.__setattr__(self, "goodput_ms", parse_goodput(self.goodput))
        parse_servers(self.servers, "--servers")
        parse_servers(self.peers, "--peers", ours=False)
        if not self.base_url and not self.servers and not self.peers:
            raise ValueError("nothing to load: give --base-url, --servers or --peers")
        if self.base_url and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        known = [*PROMPT_SETS, *SCHEMA_PROMPT_SETS]
        for name in self.prompt_sets:
            if name not in known:
                raise ValueError(f"--prompt-set: unknown set {name!r}; known: {', '.join(known)}")
            if (name in CHAT_PROMPT_SETS or name in SCHEMA_PROMPT_SETS) and self.endpoint != "chat":
                raise ValueError(f"--prompt-set {name} holds chat turns: use it with --endpoint chat")
        if not self.prompt_sets:
            raise ValueError("--prompt-set names no set")
        for flag, value in (("--num-prompts", self.num_prompts), ("--max-tokens", self.max_tokens)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not self.concurrency and not self.request_rates:
            raise ValueError("no load level: give --concurrency and/or --request-rate")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency: every level must be >= 1, got {self.concurrency}")
        if any(not (r > 0) for r in self.request_rates):
            raise ValueError(f"--request-rate: every rate must be > 0 or inf, got {self.request_rates}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"--burstiness must be a finite number > 0, got {self.burstiness}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.threads < 1 or (self.max_num_seqs is not None and self.max_num_seqs < 1):
            raise ValueError(
                f"--threads and --max-num-seqs must be >= 1, got {self.threads}, {self.max_num_seqs}"
            )
        _check_gamma(self.gamma)
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")
        for flag, value in (
            ("--request-timeout", self.request_timeout_s),
            ("--startup-timeout", self.startup_timeout_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a finite number of seconds > 0, got {value}")

    @property
    def slots(self) -> int:
        """Slots of the servers started here: ``--max-num-seqs``, else the largest concurrency, else 8."""
        return self.max_num_seqs or max(self.concurrency, default=8)

    @property
    def draft_max(self) -> int:
        """Tokens ``llama-server:eagle3`` drafts per step: ``--gamma`` when it is a depth, else 3 (its
        default, and the depth our head was trained to draft)."""
        return int(self.gamma) if self.gamma.isdigit() else 3


def _requests(config: BenchServeConfig) -> list[Any]:
    from specdec.bench.json_prompts import SCHEMA_PROMPT_SETS, load_schema_prompts
    from specdec.bench.serve_load import BenchRequest
    from specdec.prompt_sets import load_prompts

    out = []
    for name in config.prompt_sets:
        if name in SCHEMA_PROMPT_SETS:
            items = [(p.prompt, p.response_format()) for p in load_schema_prompts(name, config.num_prompts)]
        else:
            items = [(text, None) for text in load_prompts(name, config.num_prompts)]
        for text, response_format in items:
            out.append(
                BenchRequest(index=len(out), prompt=text, prompt_set=name, response_format=response_format)
            )
    return out


def _levels(config: BenchServeConfig) -> list[dict[str, Any]]:
    levels: list[dict[str, Any]] = [{"mode": "concurrency", "concurrency": c} for c in config.concurrency]
    levels += [
        {"mode": "rate", "request_rate": r, "burstiness": config.burstiness} for r in config.request_rates
    ]
    return levels


def _specs(config: BenchServeConfig) -> list[Any]:
    from specdec.bench.serve_peers import ServerSpec, parse_servers

    specs = (
        [ServerSpec(name=config.base_url, kind="url", base_url=config.base_url)] if config.base_url else []
    )
    for spec in parse_servers(config.servers, "--servers") + parse_servers(
        config.peers, "--peers", ours=False
    ):
        if spec.name not in {s.name for s in specs}:
            specs.append(spec)
    return specs


def _level_line(name: str, label: str, f: dict[str, Any], acc: dict | None) -> str:
    def ms(key: str) -> str:
        return "–" if f.get(key) is None else f"{f[key]:.1f} ms"

    text = (
        f"{name} {label}: {f['completed']} ok, {f['failed']} failed | "
        f"{f['request_throughput'] or 0:.2f} req/s, {f['output_throughput'] or 0:.1f} out tok/s"
        + ("" if f["goodput"] is None else f", goodput {f['goodput']:.2f} req/s")
        + f" | P50 TTFT {ms('ttft_p50_ms')}, TPOT {ms('tpot_p50_ms')}, ITL {ms('itl_p50_ms')}, "
        f"E2EL {ms('e2el_p50_ms')}"
    )
    if acc and acc.get("alpha") is not None:
        text += f" | α {acc['alpha']:.2f}, τ {acc['tau']:.2f}"
        if acc.get("per_position"):
            text += " (by position " + " / ".join(f"{a:.2f}" for a in acc["per_position"]) + ")"
    if f.get("json_valid") is not None:
        text += (
            f" | JSON: {f['json_valid']} valid, {f['json_invalid']} invalid (stop), "
            f"{f['json_length']} at max_tokens"
        )
    if f.get("usage_drafted"):
        text += f" | responses: {f['usage_accepted']} of {f['usage_drafted']} drafted accepted"
    if f["errors"]:
        text += " | errors: " + "; ".join(f"{n}× {e}" for e, n in f["errors"].items())
    return text


def _start(
    spec: Any, config: BenchServeConfig, out_dir: Path, prompts: Sequence[str], head: Path | None = None
) -> tuple[Any, str | None]:
    """(the launched server or None, the reason it was skipped or None); ``head``: the GGUF head of
    ``llama-server:eagle3``."""
    from specdec.bench import serve_peers as peers

    port = peers.free_port()
    log = out_dir / f"server-{spec.name.replace(':', '-')}.log"
    if spec.kind == "ours":
        cmd = peers.ours_command(
            spec.drafter, target=config.target, threads=config.threads, max_num_seqs=config.slots, port=port,
            gamma=config.gamma,
        )  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        return peers.launch(
            spec.name, cmd, log, port=port, startup_timeout_s=config.startup_timeout_s, env=env
        ), None
    skipped = peers.llama_server_skipped(spec.name, config.target)
    if skipped:
        return None, skipped
    from specdec.targets.loading import gguf_source

    binary, gguf = peers.find_llama_server(), gguf_source(config.target)
    speculation = peers.llama_speculation_args(
        spec.mode, threads=config.threads, head=head, draft_max=config.draft_max
    )
    cmd = peers.llama_server_command(
        binary,
        gguf,
        threads=config.threads,
        slots=config.slots,
        ctx_per_slot=peers.context_per_slot(prompts, config.max_tokens),
        port=port,
        model=config.model or config.target,
        speculation=speculation,
    )
    return peers.launch(spec.name, cmd, log, port=port, startup_timeout_s=config.startup_timeout_s), None


def _load(
    entry: dict[str, Any], config: BenchServeConfig, requests: list[Any], write: Callable[[], Any], say: Any
) -> None:
    """Warm-up, then every level against the server at ``entry["base_url"]``; figures into ``entry``."""
    from specdec.bench import serve_load as load
    from specdec.bench import serve_probe as probe
    from specdec.bench.json_prompts import json_validity, schema_of
    from specdec.bench.serve_peers import REQUEST_EXTRAS
    from specdec.bench.serve_report import level_figures, level_label

    base = entry["base_url"]
    auth = {"api_key": config.api_key} if entry["kind"] == "url" else {}
    model = config.model or (probe.model_card(base, **auth) or {}).get("id") or config.target
    entry["model"] = model
    sampling = {"max_tokens": config.max_tokens, "temperature": config.temperature, "seed": config.seed}
    sampling |= ({"ignore_eos": True} if config.ignore_eos else {}) | REQUEST_EXTRAS.get(entry["kind"], {})
    sampling |= entry.get("request_extras", {})
    common = dict(endpoint=config.endpoint, model=model, timeout_s=config.request_timeout_s, **auth)
    schemas = [schema_of(r.response_format) for r in requests]
    if config.warmup_requests:
        warm = load.run_closed_loop(
            base, requests[: config.warmup_requests], concurrency=1,
            sampling={**sampling, "max_tokens": min(16, config.max_tokens)}, **common,
        )  # fmt: skip
        entry["warmup_failed"] = sum(not r.ok for r in warm.results)
    for level in _levels(config):
        before, before_pos = probe.scrape_speculation(base, **auth)
        if level["mode"] == "concurrency":
            run = load.run_closed_loop(
                base, requests, concurrency=level["concurrency"], sampling=sampling, **common
            )
        else:
            run = load.run_open_loop(
                base, requests, request_rate=level["request_rate"], burstiness=config.burstiness,
                seed=config.seed, sampling=sampling, **common,
            )  # fmt: skip
        after, after_pos = probe.scrape_speculation(base, **auth)
        acc = probe.acceptance(before, after)
        if acc is not None:
            acc["per_position"] = probe.per_position(before_pos, after_pos, acc["drafts"])
        figures = level_figures(run, config.goodput_ms)
        validity, verdicts = json_validity(schemas, run.results)
        figures |= validity
        results = [r.to_dict() for r in run.results]
        for result, verdict, schema in zip(results, verdicts, schemas, strict=True):
            if verdict is not None:
                result["json_valid"] = verdict
            if schema is None:  # the text is kept where it is checked
                result.pop("text")
        entry["levels"].append({**level, **figures, "acceptance": acc, "requests": results})
        say(_level_line(entry["name"], level_label(level), figures, acc))
        write()


def _note(line: str) -> None:
    print(f"specdec bench-serve: {line}", file=sys.stderr, flush=True)


def run_bench_serve(
    config: BenchServeConfig, *, command: str = "", echo: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The benchmark (module doc); returns the record written under ``config.out``. Progress goes
    to ``echo`` (default: stdout); a skipped or failed server is one line on stderr."""
    from specdec.bench.report import environment
    from specdec.bench.serve_report import machine, write_results

    say = echo or (lambda line: print(line, flush=True))
    requests = _requests(config)
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    servers: list[dict[str, Any]] = []
    record: dict[str, Any] = {
        "command": command,
        "environment": environment(),
        "config": {k: v for k, v in asdict(config).items() if k != "api_key"},
        "num_requests": len(requests),
        "prompts": [{"index": r.index, "prompt_set": r.prompt_set} for r in requests],
        "servers": servers,
    }
    say(f"specdec bench-serve: {machine(record)}; {len(requests)} requests per level")
    from specdec.bench.serve_heads import prepare_heads

    specs = _specs(config)
    heads = prepare_heads(
        specs, target=config.target, head=config.llama_head, converter=config.llama_convert, say=say
    )
    for spec in specs:
        entry: dict[str, Any] = {
            "name": spec.name,
            "kind": spec.kind,
            "base_url": spec.base_url,
            "request_extras": dict(spec.request_extras),
            "levels": [],
        }
        servers.append(entry)
        launched = skipped = None
        head = heads.get(spec.name)
        if isinstance(head, str):
            entry["error"] = head
            _note(f"{spec.name} did not start: {head}")
            continue
        if head is not None:
            entry["head"] = str(head)
        try:
            if spec.kind != "url":
                launched, skipped = _start(spec, config, out_dir, [r.prompt for r in requests], head)
        except RuntimeError as err:
            entry["error"] = str(err)
            _note(f"{spec.name} did not start: {err}")
            continue
        if skipped:
            entry["skipped"] = skipped
            _note(skipped)
            continue
        try:
            if launched is not None:
                entry["base_url"], entry["launch"] = launched.base_url, " ".join(launched.command)
                say(f"{spec.name}: {entry['launch']}")
            _load(entry, config, requests, lambda: write_results(out_dir, record, plots=False), say)
        finally:
            if launched is not None:
                entry["exit_status"] = launched.stop(timeout_s=60.0)
                if entry["exit_status"] != 0:
                    _note(
                        f"{spec.name} exited with status {entry['exit_status']} after SIGTERM "
                        f"(log: {launched.log})"
                    )
    paths = write_results(out_dir, record)
    say("results: " + ", ".join(str(p) for p in paths))
    return record


def _check_gamma(gamma: str) -> None:
    """``--gamma``: what ``specdec serve --gamma`` takes (an integer >= 0 or a depth policy name)."""
    from specdec.engine.depth import DEPTH_POLICIES

    if not (gamma.isdigit() or gamma in DEPTH_POLICIES.names()):
        raise ValueError(
            f"--gamma must be an integer >= 0 or one of {', '.join(DEPTH_POLICIES.names())}, got {gamma!r}"
        )
