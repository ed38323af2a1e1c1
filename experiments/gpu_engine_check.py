"""The engine on an accelerator: greedy and seeded outputs of an ``hf`` target on ``--device``.

    python -m experiments.gpu_engine_check --device cuda --out "$OUT"   # on a lent GPU (about a minute)
    python -m experiments.gpu_engine_check --device cpu --out /tmp/x    # the same checks on the CPU

A tiny random Llama (transformers, seeded; no download) wrapped as :class:`specdec.targets.hf.HFTarget`
on the device, a second one as the ``model`` drafter's draft, and an untrained EAGLE head for
``eagle``. For ``none``, ``ngram``, ``model`` and ``eagle``, each check compares token ids:

- ``greedy_vs_hf``: ``specdec.generate`` greedy, one prompt at a time, equals transformers'
  ``model.generate(do_sample=False)`` on the device;
- ``batch_vs_solo``: all prompts in one ``generate`` call (one engine row each) equal the solo runs;
- ``staggered_vs_solo``: an :class:`specdec.Engine` with 2 rows, a request added at each of the first
  steps, equal the solo runs;
- ``seed_repeats``: sampled (T = 0.8, top-p 0.9) with a seed, twice, the same tokens.

Writes ``gpu_engine_check.json`` under ``--out`` (a ``specdec.summary/1`` file: a table of the
checks, with the raw record beside it: every check, its error and traceback if it raised, the
device's name, the machine) and exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main", "run_checks", "consistency_checks", "summarize", "tiny_llama", "random_eagle_head"]

DRAFTERS = ("none", "ngram", "model", "eagle")


def tiny_llama(seed: int, *, layers: int = 2, hidden: int = 64, vocab: int = 256) -> Any:
    """A random Llama small enough for any device (seeded: the same weights everywhere)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def random_eagle_head(target: Any, path: Path) -> None:
    """An untrained EAGLE head for ``target`` (seeded), saved where the ``eagle`` drafter loads it."""
    import torch

    from specdec.drafters.eagle import EagleConfig, EagleHead
    from specdec.drafters.eagle.weights import save_eagle_head

    parts = target.parts()
    torch.manual_seed(2)
    head = EagleHead(EagleConfig.from_hf_config(target.config, draft_vocab_size=target.vocab_size))
    head.draft_vocab_N = torch.arange(target.vocab_size)
    head.attach(parts)
    save_eagle_head(head.cpu(), path, target_name="tiny", embed_VD=parts.embed_VD.cpu())


def _prompts(n: int = 4) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(7)
    # repeated spans, so that ngram finds matches to draft
    base = [torch.randint(0, 256, (5 + 3 * i,), generator=g).tolist() for i in range(n)]
    return [p + p[: len(p) // 2] + p for p in base]


def consistency_checks(
    target: Any,
    drafter: str,
    drafter_options: dict[str, Any] | None,
    prompts: list[list[int]],
    solo: list[list[int]],
    *,
    new_tokens: int,
    gamma: int = 3,
) -> list[tuple[str, Any]]:
    """The engine's consistency checks for one drafter, as ``(name, fn)`` pairs; ``fn()`` returns
    ``(ok, detail)``. ``solo``: each prompt's greedy tokens generated alone (filled by the caller
    before the checks run, e.g. by a greedy check of its own):

    - ``batch_vs_solo``: all prompts in one ``generate`` call (one engine row each) equal the solo runs;
    - ``staggered_vs_solo``: an engine of 2 rows, one request joining at each step, equal the solo runs;
    - ``seed_repeats``: sampled (T = 0.8, top-p 0.9) with a seed, twice, the same tokens.
    """
    import specdec

    def gen(batch: list[list[int]], **kw) -> list[list[int]]:
        res = specdec.generate(
            target, batch, drafter=drafter, drafter_options=drafter_options, max_new_tokens=new_tokens,
            ignore_eos=True, gamma=gamma, **kw,
        )  # fmt: skip
        return [list(map(int, t)) for t in res.token_ids]

    def batch_vs_solo():
        same = [a == b for a, b in zip(gen(prompts, temperature=0.0), solo, strict=True)]
        return all(same), {"equal": same}

    def staggered_vs_solo():
        engine = specdec.Engine(
            target, drafter=drafter, drafter_options=drafter_options, gamma=gamma, max_num_seqs=2,
            max_model_len=max(len(p) for p in prompts) + new_tokens + gamma + 8,
        )  # fmt: skip
        order, tokens = {}, {}
        for i, p in enumerate(prompts):  # one request joins at each step; 2 rows, so some queue
            order[engine.add_request(p, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)] = i
            for out in engine.step():
                tokens[order[out.request_id]] = list(out.token_ids)
        while engine.has_unfinished():
            for out in engine.step():
                tokens[order[out.request_id]] = list(out.token_ids)
        same = [tokens[i] == solo[i] for i in range(len(prompts))]
        return all(same), {"equal": same}

    def seed_repeats():
        kw = {"temperature": 0.8, "top_p": 0.9, "seed": 11}
        a, b = gen(prompts, **kw), gen(prompts, **kw)
        return a == b, {"distinct_tokens": len({t for row in a for t in row})}

    return [
        ("batch_vs_solo", batch_vs_solo),
        ("staggered_vs_solo", staggered_vs_solo),
        ("seed_repeats", seed_repeats),
    ]


def run_checks(device: str, *, new_tokens: int = 24) -> dict[str, Any]:
    """Every check on ``device``; returns the record written to JSON."""
    import torch

    import specdec
    from specdec.targets.hf import HFTarget

    target = HFTarget(tiny_llama(0).to(device))
    draft = HFTarget(tiny_llama(1, layers=1).to(device))
    prompts = _prompts()
    head = Path(tempfile.mkdtemp()) / "head.safetensors"
    random_eagle_head(target, head)
    options = {"none": None, "ngram": None, "model": {"model": draft}, "eagle": {"weights": str(head)}}
    checks: list[dict[str, Any]] = []

    def check(name: str, drafter: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            ok, detail = fn()
            entry = {"check": name, "drafter": drafter, "ok": bool(ok), "detail": detail}
        except Exception as exc:  # a check that raises is a failed check, with its traceback
            entry = {"check": name, "drafter": drafter, "ok": False, "error": repr(exc)}
            entry["traceback"] = traceback.format_exc(limit=-12)
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        checks.append(entry)
        print(
            f"{'ok  ' if entry['ok'] else 'FAIL'} {name:<18} {drafter:<6} {entry.get('error', '')}",
            flush=True,
        )

    with torch.inference_mode():
        reference = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = target.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
            )
            reference.append(out[0, len(p) :].tolist())

    def gen(drafter: str, batch: list[list[int]], **kw) -> list[list[int]]:
        res = specdec.generate(
            target, batch, drafter=drafter, drafter_options=options[drafter], max_new_tokens=new_tokens,
            ignore_eos=True, gamma=3, **kw,
        )  # fmt: skip
        return [list(map(int, t)) for t in res.token_ids]

    for d in DRAFTERS:
        solo: list[list[int]] = []

        def greedy_vs_hf(d=d, solo=solo):
            solo += [gen(d, [p], temperature=0.0)[0] for p in prompts]
            same = [a == b for a, b in zip(solo, reference, strict=True)]
            return all(same), {"equal": same}

        check("greedy_vs_hf", d, greedy_vs_hf)
        for name, fn in consistency_checks(target, d, options[d], prompts, solo, new_tokens=new_tokens):
            check(name, d, fn)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return {
        "device": device,
        "device_name": name,
        "torch": torch.__version__,
        "checks": checks,
        "passed": all(c["ok"] for c in checks),
    }


def summarize(record: dict[str, Any]) -> Any:
    """The results-schema summary of a record: one row per (drafter, check)."""
    from specdec.summary import Summary, table_from_rows

    rows = [
        {
            "drafter": c["drafter"],
            "check": c["check"],
            "ok": "yes" if c["ok"] else "NO",
            "seconds": c["seconds"],
        }
        for c in record["checks"]
    ]
    columns = [
        ("drafter", "drafter", ""),
        ("check", "check", ""),
        ("ok", "passed", ""),
        ("seconds", "s", ".2f"),
    ]
    caption = f"The engine on {record['device_name']} ({record['device']}): token ids against the references"
    return Summary(
        title="The engine on an accelerator",
        tables=(table_from_rows("gpu-engine-check", caption, columns, rows),),
    )


def main(argv: list[str] | None = None) -> int:
    from specdec.bench.report import benchmark_document, environment
    from specdec.summary import write_results

    p = argparse.ArgumentParser(prog="python -m experiments.gpu_engine_check", description=__doc__)
    p.add_argument("--device", default="cuda", help="torch device of the target and the draft (cuda)")
    p.add_argument("--out", required=True, help="folder for gpu_engine_check.json")
    args = p.parse_args(argv)
    record = run_checks(args.device)
    record = {"command": " ".join(["python -m experiments.gpu_engine_check", *(argv or sys.argv[1:])]),
              "environment": environment(), **record}  # fmt: skip
    document = benchmark_document(
        record, experiment="gpu-engine-check", summarize=summarize, description=__doc__.split("\n\n")[0]
    )
    write_results(Path(args.out) / "gpu_engine_check.json", document)
    passed = sum(c["ok"] for c in record["checks"])
    print(f"{passed}/{len(record['checks'])} checks passed on {record['device_name']}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
