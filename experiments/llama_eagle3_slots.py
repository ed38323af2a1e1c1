"""Does llama-server's EAGLE-3 acceptance depend on its busy slots? The minimal case for issue 46's
multi-slot collapse (``docs/serving.md``, "llama.cpp's EAGLE-3 with several slots").

Legend: P the probe prompt, N neighbour prompts, S the server's slots (``-np``).

One ``llama-server --spec-type draft-eagle3`` with S slots, our EAGLE-3 head converted for it
(:mod:`specdec.bench.serve_heads`), greedy chat requests of ``max_tokens`` tokens, prompt cache off.
Each prompt P of the held-out sets is sent

- **alone**: the only request in the server;
- **beside N others**: P and N other prompts sent at the same moment, so P drafts while N other
  slots are busy.

Per condition it reports P's own drafted and accepted tokens (the response's ``timings.draft_n`` /
``draft_n_accepted``) and whether P's text is the one it got alone. The head, the GGUF files, the
prompt and the server process are the same in both conditions: only the other slots differ, so a
drop in P's acceptance beside others is llama.cpp's handling of several sequences, not the head or
its export. With ``--ours`` the same requests go to ``specdec serve --drafter eagle --gamma 3`` as
well (our engine's drafts of a row do not depend on its neighbours).

    LLAMA_SERVER=/work/llama-build/bin/llama-server python -m experiments.llama_eagle3_slots \\
        --num-prompts 4 --neighbours 3 --out /tmp/llama-eagle3-slots.json --ours
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from specdec.bench import serve_heads, serve_peers

__all__ = ["main", "probe"]


def _chat(base_url: str, prompt: str, max_tokens: int, model: str) -> dict[str, Any]:
    """One greedy chat request; ``{"text", "drafted", "accepted"}`` from its response."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "cache_prompt": False,
    }
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600.0)
    reply.raise_for_status()
    data = reply.json()
    timings = data.get("timings") or {}
    usage = data.get("usage") or {}
    drafted = timings.get("draft_n", usage.get("num_draft_tokens", 0))
    accepted = timings.get("draft_n_accepted", usage.get("num_accepted_tokens", 0))
    return {"text": data["choices"][0]["message"]["content"], "drafted": drafted, "accepted": accepted}


def _together(base_url: str, prompts: list[str], max_tokens: int, model: str) -> list[dict[str, Any]]:
    """The prompts sent at the same moment, one thread each."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _chat(base_url, p, max_tokens, model), prompts))


def probe(
    base_url: str, prompts: list[str], *, neighbours: int, max_tokens: int, model: str, say=print
) -> list[dict[str, Any]]:
    """Each prompt alone, then beside ``neighbours`` others (the next prompts of the list, cyclic):
    one row per prompt with both conditions' counts and whether the texts agree."""
    rows = []
    for i, prompt in enumerate(prompts):
        alone = _chat(base_url, prompt, max_tokens, model)
        others = [prompts[(i + 1 + j) % len(prompts)] for j in range(neighbours)]
        busy = _together(base_url, [prompt, *others], max_tokens, model)[0]
        row = {"prompt": i, "alone": alone, "beside_others": busy, "same_text": alone["text"] == busy["text"]}
        for side in ("alone", "beside_others"):
            d, a = row[side]["drafted"], row[side]["accepted"]
            row[side]["acceptance"] = a / d if d else None
            del row[side]["text"]
        rows.append(row)
        say(
            f"prompt {i}: alone {alone['accepted']}/{alone['drafted']} accepted, "
            f"beside {neighbours} others {busy['accepted']}/{busy['drafted']}, same text: {row['same_text']}"
        )
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in ("alone", "beside_others"):
        d = sum(r[side]["drafted"] for r in rows)
        a = sum(r[side]["accepted"] for r in rows)
        out[side] = {"drafted": d, "accepted": a, "acceptance": a / d if d else None}
    out["same_text"] = sum(r["same_text"] for r in rows)
    out["prompts"] = len(rows)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.llama_eagle3_slots", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--head", default=None, help="EAGLE-3 head (default: the exportable shipped head)")
    parser.add_argument(
        "--prompt-set", action="append", default=None, help="humaneval, mtbench (default both)"
    )
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per set")
    parser.add_argument("--neighbours", type=int, default=3, help="other requests in flight beside the probe")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft-max", type=int, default=3, help="--spec-draft-n-max (and ours' --gamma)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ours", action="store_true", help="also probe specdec serve --drafter eagle")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the rows and summary")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "neighbours", "max_tokens", "draft_max", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    from specdec.prompt_sets import load_prompts
    from specdec.targets.loading import gguf_source

    binary = serve_peers.find_llama_server()
    if binary is None:
        print(f"no llama-server: set ${serve_peers.LLAMA_SERVER_ENV} or put it on PATH", file=sys.stderr)
        return 2
    prompts = [
        p for s in (args.prompt_set or ["humaneval", "mtbench"]) for p in load_prompts(s, args.num_prompts)
    ]
    converter = serve_heads.find_converter(binary, os.environ.get("LLAMA_CONVERT"))
    head = serve_heads.prepare_eagle3_head(args.target, converter=converter, head=args.head, say=print)
    gguf = gguf_source(args.target)
    slots = args.neighbours + 1
    ctx = serve_peers.context_per_slot(prompts, args.max_tokens)
    logs = Path(tempfile.mkdtemp(prefix="llama-eagle3-slots-"))
    result: dict[str, Any] = {
        "command": "python -m experiments.llama_eagle3_slots "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "llama_server": str(binary),
        "head": str(head),
        "slots": slots,
        "max_tokens": args.max_tokens,
        "draft_max": args.draft_max,
        "servers": {},
    }
    servers = [("llama-server:eagle3", None)] + ([("ours:eagle", "eagle")] if args.ours else [])
    for name, drafter in servers:
        port = serve_peers.free_port()
        if drafter is None:
            spec = serve_peers.llama_speculation_args(
                "eagle3", threads=args.threads, head=head, draft_max=args.draft_max
            )
            command = serve_peers.llama_server_command(
                binary, gguf, threads=args.threads, slots=slots, ctx_per_slot=ctx, port=port,
                model=args.target, speculation=spec,
            )  # fmt: skip
        else:
            command = serve_peers.ours_command(
                drafter, target=args.target, threads=args.threads, max_num_seqs=slots, port=port,
                gamma=str(args.draft_max),
            )  # fmt: skip
        print(f"{name}: {' '.join(command)}")
        server = serve_peers.launch(
            name, command, logs / f"{name.replace(':', '-')}.log", port=port, startup_timeout_s=300
        )
        try:
            t0 = time.perf_counter()
            rows = probe(
                server.base_url,
                prompts,
                neighbours=args.neighbours,
                max_tokens=args.max_tokens,
                model=args.target,
            )
            result["servers"][name] = {"command": command, "rows": rows, "summary": _summary(rows),
                                       "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        finally:
            server.stop()
        print(f"{name}: {json.dumps(result['servers'][name]['summary'])}")
    if args.out is not None:
        from specdec.summary import write_results

        write_results(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
