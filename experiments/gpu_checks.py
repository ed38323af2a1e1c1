"""The checks of ``python -m experiments.gpu_check``, one function each (``check_<name>(ctx) -> dict``).

Legend: B batch, T block tokens, V vocabulary, D model dim, F MLP dim, H query heads, J key/value heads,
E head dim.

A check returns its figures with ``ok`` (pass or fail), or raises :class:`Skip` with the reason it
cannot run here; ``experiments.gpu_check`` runs them in order, each under its own time bound, and
writes the file. What each check measures is listed in that module's docstring and in docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Context",
    "Skip",
    "TEXTS",
    "LLAMA_31_8B",
    "SMALL_LLAMA",
    "HBM_BYTES_PER_S",
    "hbm_bandwidth",
    "random_llama",
    "count_syncs",
]

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
        try:
            target = ctx.load(w)
            out = specdec.generate(
                target, prompts, max_new_tokens=ctx.new_tokens, temperature=0.0, ignore_eos=True
            )
            ours = [list(map(int, t)) for t in out.token_ids]
            equal = [a == b for a, b in zip(ours, reference, strict=True)]
            agree = _teacher_forced_agreement(target, prompts, reference)
        except Exception as exc:  # one format's error fails the check, the other formats still run
            formats[w], ok = {"status": "fail", "error": repr(exc)}, False
            print(f"    {w:<5} FAIL {exc!r}", flush=True)
            continue
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


def count_syncs(fn: Callable[[], Any]) -> dict[str, int | None]:
    """Device-to-host synchronisations while ``fn`` runs, counted by the warnings of
    ``torch.cuda.set_sync_debug_mode("warn")`` (``torch``: ``.item()``, ``.cpu()``, ``.tolist()``,
    blocking copies, stream syncs; not ``Event.synchronize``), and by the engine's own counter,
    ``specdec.engine.host_sync.count_host_syncs``, where it has one (``engine``; None otherwise)."""
    import torch

    try:
        from specdec.engine.host_sync import count_host_syncs  # type: ignore[import-not-found]
    except ImportError:
        count_host_syncs = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with count_host_syncs() if count_host_syncs else contextlib.nullcontext() as counter:
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    engine = getattr(counter, "count", None)
    return {"torch": sum("synchroniz" in str(w.message) for w in caught), "engine": engine}


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
        per_step = syncs["torch"] / max(steps[0], 1)
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
