"""GPU correctness checks and grouped-GEMM benchmark for the `kernels` package, in one prepared run.

    python -m experiments.gpu_moe_bench [--out DIR] [--budget-s 420]   # on a CUDA GPU (an H200)
    python -m experiments.gpu_moe_bench --dry-run [--out DIR]          # CPU, TRITON_INTERPRET=1, tiny shapes

Legend: T tokens, E experts, K input features, N output features, M = T * top_k rows in expert order.

Phases (JSON is rewritten after each one, so a run cut short keeps what it finished):
  0. variants   every config the forward kernel's autotuner may pick (tile shape, TMA or pointer loads,
                flattened tile+K loop or not), run one by one in bf16 on an odd problem with empty
                experts, both weight layouts, against the float64 reference; if no flattened config
                compiles, SPECDEC_TRITON_FLATTEN=0 is set for the rest of the run (and reported).
  1. checks     Triton kernels against the references on the device: grouped GEMM forward/dX/dW in fp32,
                bf16 and fp16, both weight layouts, TMA on and off, odd shapes and empty experts; top-k
                routing, sort, permute and unpermute (forward and backward) against the torch backend.
  2. peak       the measured bf16 matrix rate: one large square torch.mm (the "peak" the ratios use).
  3. gemm       our Triton grouped GEMM forward in bf16 (autotuned; TMA and pointer paths, and the
                [E, N, K] weight layout) on Mixtral-like (E=8, top-2) and DeepSeek/Qwen-like (E=64-128,
                top-6/8) expert shapes, against (a) one cuBLAS GEMM with the same M, K, N (same FLOPs),
                (b) torch._grouped_mm on the same problem (the better of its two weight layouts), (c) the
                measured peak; each Triton output is checked against the cuBLAS-backed torch backend.
                The autotuner's timing of every candidate is kept per row (`tuning`), with the gain of
                the flattened loop and of TMA over the best candidate without them. Every variant is
                also timed replayed from a CUDA graph (`ms_graph`: host-side work excluded alike).
  4. routing    Triton routing ops against the torch backend at large T (times only; correctness is phase 1).
Timing: ``specdec.bench.interleave.time_interleaved`` with CUDA events around each call
(``cuda_clock``), after warm-up, with the L2 flushed before every timed call; the median is reported.
The issue's goals (>= 0.8x cuBLAS, >= 1.0x torch._grouped_mm at large T) are printed as PASS/MISS per
row. Device time budget on a lent H200: about 5 minutes including Triton compilation.
This file is a script: nothing imports it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import statistics
import sys
import time
import warnings

# (model, E, top_k, D, F): expert shapes of public MoE models; each gives two GEMMs per expert:
# gate_up (K=D, N=2F, fused gate and up projections) and down (K=F, N=D).
GPU_MODELS = [
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("deepseek-v2-lite", 64, 6, 2048, 1408),
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
]
GPU_TOKENS = [4096, 16384]
DRY_MODELS = [("moe-tiny", 16, 4, 32, 24)]
DRY_TOKENS = [12]


def main(argv: list[str] | None = None) -> int:
    """Run all phases; exit status 1 if any correctness check failed."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "results/gpu_moe_bench"), help="output folder")
    parser.add_argument(
        "--dry-run", "--interpret", dest="dry_run", action="store_true", help="CPU interpreter run"
    )
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="skip benchmark rows after this many seconds"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python experiments/...` works too

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run for the CPU interpreter mode")
    command = " ".join(["python -m experiments.gpu_moe_bench", *(argv if argv is not None else sys.argv[1:])])
    bench = Bench(
        torch, dry_run=args.dry_run, out_dir=pathlib.Path(args.out), budget_s=args.budget_s, command=command
    )
    return bench.run()


class Bench:
    """State of one run: the device, the report being built, and the timer."""

    def __init__(
        self, torch, *, dry_run: bool, out_dir: pathlib.Path, budget_s: float, command: str = ""
    ) -> None:
        import kernels

        self.torch, self.kernels, self.dry_run = torch, kernels, dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.out_path = out_dir / "gpu_moe_bench.json"
        self.command = command  # for the results file
        self.start, self.budget_s = time.time(), budget_s
        self.gen = torch.Generator(device=self.device).manual_seed(0)
        self.flush_buffer = (
            None if dry_run else torch.empty(256 * 2**20, dtype=torch.int8, device=self.device)
        )
        self.report = {
            "report_schema": "specdec-gpu-moe-bench/1",
            "mode": "dry-run (TRITON_INTERPRET=1, CPU, tiny shapes)" if dry_run else "gpu",
            "device": "cpu" if dry_run else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "cuda": torch.version.cuda,
            "checks": [],
            "variants": [],
            "peak": None,
            "gemm": [],
            "routing": [],
        }

    # ------------------------------------------------------------------ helpers
    def log(self, message: str) -> None:
        print(f"[{time.time() - self.start:7.1f}s] {message}", flush=True)

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.time() - self.start, 1)
        from experiments.gpu_moe_report import gpu_document
        from specdec.summary import write_results

        write_results(self.out_path, gpu_document(self.report, self.command))

    def randn(self, *shape, dtype=None, scale: float = 1.0):
        t = self.torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.torch.float32)
        return (t * scale).to(dtype or self.torch.float32)

    def time_ms(self, fn) -> float:
        """Median milliseconds of fn() by the project's timer (``specdec.bench.interleave``): CUDA
        events, the L2 flushed before each call, after 4 warm-up calls, as many calls as fit in 0.3 s
        (5 to 50); in the CPU interpreter one wall-clock call after one warm-up (the code path runs;
        the number means nothing)."""
        from specdec.bench.interleave import cuda_clock, time_interleaved

        if self.dry_run:
            times = time_interleaved({"fn": fn}, min_reps=1, max_reps=1, warmup=1)
        else:
            times = time_interleaved(
                {"fn": fn},
                seconds=0.3,
                min_reps=5,
                max_reps=50,
                warmup=4,
                before=self.flush_buffer.zero_,
                clock=cuda_clock,
            )
        return 1e3 * statistics.median(times["fn"])

    def time_ms_graph(self, fn) -> float:
        """Median milliseconds of fn() replayed from a CUDA graph (host-side work excluded, for every
        variant alike): a graph of [L2 flush, fn] minus a graph of the flush alone, the two replayed
        interleaved. Call after fn has run once outside capture (autotuning must not happen inside
        the capture)."""
        from specdec.bench.interleave import cuda_clock, time_interleaved

        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graphs = {}
        for name, body in (("flush", lambda: None), ("fn", fn)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.flush_buffer.zero_()
                body()
            graphs[name] = graph
        times = time_interleaved(
            {name: graph.replay for name, graph in graphs.items()},
            min_reps=20,
            max_reps=20,
            warmup=1,
            clock=cuda_clock,
        )
        medians = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        return max(medians["fn"] - medians["flush"], 1e-6)

    def routing_plan(self, num_tokens: int, num_experts: int, top_k: int):
        """Group sizes of a random router's top-k choice (roughly balanced, as in a trained model)."""
        logits_TE = self.randn(num_tokens, num_experts)
        _, experts_TK = self.kernels.topk_routing(logits_TE, top_k, backend="torch")
        return self.kernels.sort_by_expert(experts_TK, num_experts, backend="torch")

    def check(self, name: str, actual, expected, tol: float) -> None:
        torch = self.torch
        actual, expected = actual.detach().double(), expected.detach().double()
        finite = bool(torch.isfinite(actual).all())
        denom = expected.norm().item() or 1.0
        rel = (actual - expected).norm().item() / denom if finite else float("inf")
        ok = finite and rel <= tol
        self.report["checks"].append({"name": name, "rel_err": rel, "tol": tol, "ok": ok})
        if not ok:
            self.log(f"CHECK FAILED {name}: rel_err={rel:.3g} tol={tol:g} finite={finite}")

    # ------------------------------------------------------------------ phase 1: correctness
    def run_checks(self) -> None:
        torch, kernels = self.torch, self.kernels
        os.environ["SPECDEC_TRITON_AUTOTUNE"] = "0"  # one config per dtype here: compile time is device time
        cases = [(37, 19, 23, [5, 0, 20, 12])]
        if not self.dry_run:
            cases += [
                (300, 64, 96, [0, 100, 0, 150, 50]),
                (3000, 512, 768, [0, 700, 1, 0, 1299, 500, 500, 0]),
            ]
        dtypes = [torch.float32, torch.bfloat16] + ([] if self.dry_run else [torch.float16])
        tols = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}
        for m, k, n, sizes in cases:
            for dtype in dtypes:
                for layout in ("EKN", "ENK"):
                    for tma in ("1", "0"):
                        os.environ["SPECDEC_TRITON_TMA"] = tma
                        name = f"grouped_gemm {m}x{k}x{n} E={len(sizes)} {str(dtype)[6:]} {layout} tma={tma}"
                        self.guarded(
                            name, self.check_grouped_gemm, name, m, k, n, sizes, dtype, layout, tols[dtype]
                        )
        os.environ.pop("SPECDEC_TRITON_TMA")
        os.environ.pop("SPECDEC_TRITON_AUTOTUNE")
        self.log(f"grouped GEMM checks: {sum(c['ok'] for c in self.report['checks'])} ok")

        num_tokens = 40 if self.dry_run else 10000
        expert_shapes = ((8, 2), (16, 4)) if self.dry_run else ((8, 2), (64, 6), (128, 8), (256, 8))
        for num_experts, top_k in expert_shapes:
            logits_TE = self.randn(num_tokens, num_experts, scale=2.0)
            bias_E = self.randn(num_experts)
            for scoring in ("softmax", "sigmoid"):
                for renormalize in (False, True):
                    for bias in (None, bias_E):
                        name = f"topk E={num_experts} k={top_k} {scoring} renorm={renormalize}"
                        name += f" bias={bias is not None}"
                        self.guarded(
                            name, self.check_topk, name, logits_TE, top_k, scoring, renormalize, bias
                        )
            weights_TK, experts_TK = kernels.topk_routing(logits_TE, top_k, backend="torch")
            plan = kernels.sort_by_expert(experts_TK, num_experts, backend="torch")
            name = f"sort_by_expert T={num_tokens} E={num_experts}"
            self.guarded(name, self.check_sort, name, experts_TK, plan)
            for dtype in (torch.float32, torch.bfloat16):
                label = f"E={num_experts} {str(dtype)[6:]}"
                self.guarded(
                    f"permute {label}",
                    self.check_permute,
                    plan.sorted_slots_M,
                    weights_TK,
                    top_k,
                    dtype,
                    label,
                )
        bad = [c["name"] for c in self.report["checks"] if not c["ok"]]
        self.log(f"checks: {len(self.report['checks']) - len(bad)} ok, {len(bad)} failed")

    def run_variants(self) -> None:
        """Every autotune candidate on its own, so a config that only wins on some shape is checked too."""
        torch = self.torch
        from kernels.grouped_gemm import grouped_gemm_reference, triton_kernel

        sizes = [3, 0, 5] if self.dry_run else [0, 300, 17, 0, 513, 129, 1, 64]
        k, n = (32, 48) if self.dry_run else (208, 336)  # multiples of 16 (TMA), not of the tiles
        group_sizes_E = torch.tensor(sizes, device=self.device)
        dtype = torch.float32 if self.dry_run else torch.bfloat16
        x_MK = self.randn(sum(sizes), k, dtype=dtype)
        w_EKN = self.randn(len(sizes), k, n, dtype=dtype, scale=k**-0.5)
        expected = grouped_gemm_reference(x_MK.double(), w_EKN.double(), group_sizes_E.cpu())
        flatten_ok = False
        for trans_w, w in ((False, w_EKN), (True, w_EKN.transpose(1, 2).contiguous())):
            for config in triton_kernel._forward_configs():
                name = f"variant {'ENK' if trans_w else 'EKN'} {_config_name(config)}"
                row = {"name": name, "config": _config_dict(config), "trans_w": trans_w}
                try:
                    y_MN = triton_kernel.grouped_gemm_triton_config(x_MK, w, group_sizes_E, trans_w, config)
                    self.check(name, y_MN, expected, 1e-2)
                    row["ok"] = self.report["checks"][-1]["ok"]
                    flatten_ok |= row["ok"] and config.kwargs["FLATTEN"]
                except Exception as err:  # a config that does not compile here: reported, not fatal
                    row.update(ok=False, error=f"{type(err).__name__}: {err}"[:500])
                    self.log(f"variant failed {name}: {row['error'][:200]}")
                self.report["variants"].append(row)
        if not flatten_ok:
            os.environ[triton_kernel.FLATTEN_ENV_VAR] = "0"
            self.report["flatten_disabled"] = True
        good = sum(r["ok"] for r in self.report["variants"])
        self.log(
            f"variants: {good} of {len(self.report['variants'])} configs correct; flatten ok: {flatten_ok}"
        )

    def guarded(self, name: str, check, *args) -> None:
        """Run one check; an exception (a kernel that fails to compile, say) is a failed check."""
        try:
            check(*args)
        except Exception as err:
            self.report["checks"].append(
                {"name": name, "ok": False, "error": f"{type(err).__name__}: {err}"[:500]}
            )
            self.log(f"CHECK FAILED {name}: {type(err).__name__}: {str(err)[:300]}")

    def check_sort(self, name: str, experts_TK, plan) -> None:
        """Triton counting sort: the same permutation, sizes and offsets as the torch stable sort."""
        got = self.kernels.sort_by_expert(experts_TK, plan.group_sizes_E.shape[0], backend="triton")
        same = all(self.torch.equal(a, b) for a, b in zip(got, plan, strict=True))
        self.report["checks"].append({"name": name, "ok": same})

    def check_grouped_gemm(
        self, name: str, m: int, k: int, n: int, sizes: list[int], dtype, layout, tol
    ) -> None:
        """Triton forward, dX and dW against autograd through the float64 reference."""
        torch = self.torch
        from kernels.grouped_gemm import grouped_gemm_reference

        group_sizes_E = torch.tensor(sizes, device=self.device)
        x = self.randn(m, k, dtype=dtype).requires_grad_()
        if layout == "EKN":
            w = self.randn(len(sizes), k, n, dtype=dtype).requires_grad_()
        else:  # nn.Linear-style storage [E, N, K], passed as a transposed view
            w = self.randn(len(sizes), n, k, dtype=dtype).transpose(1, 2).requires_grad_()
        y = self.kernels.grouped_gemm(x, w, group_sizes_E, backend="triton")
        dy = self.randn(m, n, dtype=dtype)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        x64 = x.detach().double().requires_grad_()
        w64 = w.detach().double().requires_grad_()
        y64 = grouped_gemm_reference(x64, w64, group_sizes_E.cpu())
        dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
        self.check(name + " y", y, y64, tol)
        self.check(name + " dx", dx, dx64, tol)
        self.check(name + " dw", dw, dw64, tol)

    def check_topk(self, name: str, logits_TE, top_k: int, scoring: str, renormalize: bool, bias_E) -> None:
        """Triton top-k routing against the torch backend: same ids, weights and logit gradients."""
        grad_TK = self.randn(logits_TE.shape[0], top_k)
        out = {}
        for backend in ("triton", "torch"):
            leaf = logits_TE.clone().requires_grad_()
            weights_TK, experts_TK = self.kernels.topk_routing(
                leaf, top_k, scoring=scoring, renormalize=renormalize, bias_E=bias_E, backend=backend
            )
            (grad,) = self.torch.autograd.grad(weights_TK, leaf, grad_TK)
            out[backend] = (weights_TK, experts_TK, grad)
        name = (
            f"topk E={logits_TE.shape[1]} k={top_k} {scoring} renorm={renormalize} bias={bias_E is not None}"
        )
        same_ids = self.torch.equal(out["triton"][1], out["torch"][1])
        self.report["checks"].append({"name": name + " ids", "ok": same_ids})
        self.check(name + " weights", out["triton"][0], out["torch"][0], 1e-6)
        self.check(name + " grad", out["triton"][2], out["torch"][2], 1e-5)

    def check_permute(self, sorted_slots_M, weights_TK, top_k: int, dtype, label: str) -> None:
        """Triton permute + unpermute, forward and backward, against the torch backend on the same inputs."""
        num_tokens, dim = weights_TK.shape[0], 96
        x_TD = self.randn(num_tokens, dim, dtype=dtype)
        grad_TD = self.randn(num_tokens, dim, dtype=dtype)
        res = {}
        for backend in ("triton", "torch"):
            x = x_TD.clone().requires_grad_()
            weights = weights_TK.clone().requires_grad_()
            x_MD = self.kernels.permute(x, sorted_slots_M, top_k, backend=backend)
            y_TD = self.kernels.unpermute(x_MD * 0.5, sorted_slots_M, weights, backend=backend)
            res[backend] = (y_TD, *self.torch.autograd.grad(y_TD, (x, weights), grad_TD))
        tol = 1e-6 if dtype == self.torch.float32 else 1e-2
        for what, a, b in zip(("out", "dx", "dweights"), res["triton"], res["torch"], strict=True):
            self.check(f"permute/unpermute {label} {what}", a, b, tol)

    # ------------------------------------------------------------------ phase 2: peak
    def run_peak(self) -> None:
        torch = self.torch
        size = 256 if self.dry_run else 8192
        dtype = torch.bfloat16
        a, b = self.randn(size, size, dtype=dtype), self.randn(size, size, dtype=dtype)
        ms = self.time_ms(lambda: a @ b)
        tflops = 2 * size**3 / ms / 1e9
        self.report["peak"] = {"shape": size, "dtype": "bf16", "ms": ms, "tflops": tflops}
        self.log(f"peak: {size}^3 bf16 torch.mm {tflops:.1f} TFLOP/s")

    # ------------------------------------------------------------------ phase 3: grouped GEMM
    def run_gemm(self) -> None:
        torch, kernels = self.torch, self.kernels
        models, tokens = (DRY_MODELS, DRY_TOKENS) if self.dry_run else (GPU_MODELS, GPU_TOKENS)
        dtype = torch.bfloat16
        peak = self.report["peak"]["tflops"]
        for model, num_experts, top_k, dim, hidden in models:
            for num_tokens in tokens:
                plan = self.routing_plan(num_tokens, num_experts, top_k)
                for gemm, (k, n) in (("gate_up", (dim, 2 * hidden)), ("down", (hidden, dim))):
                    row = {"model": model, "T": num_tokens, "gemm": gemm, "E": num_experts, "top_k": top_k}
                    if time.time() - self.start > self.budget_s:
                        self.report["gemm"].append({**row, "skipped": "budget"})
                        continue
                    row.update(self.time_gemm(num_tokens * top_k, k, n, plan.group_sizes_E, dtype))
                    row["ratios"] = _ratios(row["tflops"], peak)
                    self.check(
                        f"bench {model} T={num_tokens} {gemm} triton vs torch", *self.last_outputs, 1e-2
                    )
                    self.report["gemm"].append(row)
                    self.log(_gemm_line(row))
                    self.save()
        self.report["autotune"] = kernels.triton_autotune_choices()

    def time_gemm(self, rows: int, k: int, n: int, sizes_E, dtype) -> dict:
        """Times (ms) and TFLOP/s of every variant on one [rows, k] x [E, k, n] problem."""
        torch = self.torch
        x_MK = self.randn(rows, k, dtype=dtype)
        w_EKN = self.randn(sizes_E.shape[0], k, n, dtype=dtype, scale=k**-0.5)
        w_ENK = w_EKN.transpose(1, 2).contiguous()
        offsets_E = torch.cumsum(sizes_E, 0).to(torch.int32)
        op = torch.ops.specdec_kernels.grouped_gemm  # the registered op: no host-side validation sync
        variants = {  # name: (SPECDEC_TRITON_TMA, call)
            "triton": ("1", lambda: op(x_MK, w_EKN, sizes_E, False, "triton")),
            "triton_no_tma": ("0", lambda: op(x_MK, w_EKN, sizes_E, False, "triton")),
            "triton_ENK": ("1", lambda: op(x_MK, w_ENK, sizes_E, True, "triton")),
            "grouped_mm": ("1", lambda: torch._grouped_mm(x_MK, w_EKN, offs=offsets_E)),
            "grouped_mm_ENK": ("1", lambda: torch._grouped_mm(x_MK, w_ENK.transpose(1, 2), offs=offsets_E)),
            "cublas_dense": ("1", lambda: x_MK @ w_EKN[0]),
        }
        out = {"M": rows, "K": k, "N": n, "flops": 2 * rows * k * n, "ms": {}, "errors": {}, "warnings": []}
        out["tuning"] = {}
        from kernels.grouped_gemm import triton_kernel

        tuner = triton_kernel.grouped_gemm_forward_kernel
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, (tma, fn) in variants.items():
                os.environ["SPECDEC_TRITON_TMA"] = tma
                keys = set(tuner.cache)
                try:
                    out["ms"][name] = self.time_ms(fn)
                except Exception as err:  # e.g. torch._grouped_mm unsupported here: report it, go on
                    out["errors"][name] = f"{type(err).__name__}: {err}"[:500]
                if name.startswith("triton") and set(tuner.cache) - keys:  # this call tuned a new key
                    out["tuning"][name] = _tuning(tuner)
            # the same calls replayed from CUDA graphs: kernel time without the host-side path
            out["ms_graph"], out["graph_errors"] = {}, {}
            if not self.dry_run:
                for name, (tma, fn) in variants.items():
                    if name not in out["ms"]:
                        continue
                    os.environ["SPECDEC_TRITON_TMA"] = tma
                    try:
                        out["ms_graph"][name] = self.time_ms_graph(fn)
                    except Exception as err:  # not capturable here: reported, not fatal
                        out["graph_errors"][name] = f"{type(err).__name__}: {err}"[:500]
            os.environ.pop("SPECDEC_TRITON_TMA")
        out["warnings"] = sorted({str(w.message)[:500] for w in caught})
        out["tflops_graph"] = {v: out["flops"] / ms / 1e9 for v, ms in out["ms_graph"].items()}
        out["tflops"] = {v: out["flops"] / ms / 1e9 for v, ms in out["ms"].items()}
        if "triton" in out["ms"]:
            reference = self.kernels.grouped_gemm(x_MK, w_EKN, sizes_E, backend="torch")
            self.last_outputs = (variants["triton"][1](), reference)
        else:
            self.last_outputs = None
        return out

    # ------------------------------------------------------------------ phase 4: routing ops
    def run_routing(self) -> None:
        torch = self.torch
        num_tokens = 64 if self.dry_run else 16384
        dim = 32 if self.dry_run else 4096
        for num_experts, top_k in ((8, 2), (32, 4)) if self.dry_run else ((8, 2), (128, 8)):
            if time.time() - self.start > self.budget_s:
                break
            logits_TE = self.randn(num_tokens, num_experts)
            x_TD = self.randn(num_tokens, dim, dtype=torch.bfloat16)
            row = {"T": num_tokens, "D": dim, "E": num_experts, "top_k": top_k, "ms": {}}
            for backend in ("triton", "torch"):
                row["ms"][backend] = self.time_routing(backend, logits_TE, x_TD, top_k)
            self.report["routing"].append(row)
            speedups = {op: row["ms"]["torch"][op] / row["ms"]["triton"][op] for op in row["ms"]["triton"]}
            self.log(
                f"routing T={num_tokens} E={num_experts} k={top_k}: triton speed-up over torch "
                + ", ".join(f"{op} {s:.2f}x" for op, s in speedups.items())
            )

    def time_routing(self, backend: str, logits_TE, x_TD, top_k: int) -> dict:
        """Milliseconds of each routing op on one backend."""
        kernels, num_experts = self.kernels, logits_TE.shape[1]
        weights_TK, experts_TK = kernels.topk_routing(logits_TE, top_k, renormalize=True, backend=backend)
        slots_M, _, _ = kernels.sort_by_expert(experts_TK, num_experts, backend=backend)
        x_MD = kernels.permute(x_TD, slots_M, top_k, backend=backend)
        return {
            "topk_routing": self.time_ms(lambda: kernels.topk_routing(logits_TE, top_k, backend=backend)),
            "sort_by_expert": self.time_ms(
                lambda: kernels.sort_by_expert(experts_TK, num_experts, backend=backend)
            ),
            "permute": self.time_ms(lambda: kernels.permute(x_TD, slots_M, top_k, backend=backend)),
            "unpermute": self.time_ms(lambda: kernels.unpermute(x_MD, slots_M, weights_TK, backend=backend)),
        }

    # ------------------------------------------------------------------ driver
    def run(self) -> int:
        torch = self.torch
        self.log(f"{self.report['device']}: torch {torch.__version__}, triton {self.report['triton']}")
        for phase in (self.run_variants, self.run_checks, self.run_peak, self.run_gemm, self.run_routing):
            phase()
            self.save()
        failed = [c["name"] for c in self.report["checks"] if not c["ok"]]
        print(_summary(self.report))
        self.log(f"wrote {self.out_path}; {len(failed)} failed checks")
        return 1 if failed else 0


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _config_dict(config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _config_name(config) -> str:
    c = config.kwargs
    return (
        f"{c['BM']}x{c['BN']}x{c['BK']} w{config.num_warps} s{config.num_stages} x{c['PROGRAMS_PER_SM']}"
        f"{' tma' if c['USE_TMA'] else ''}{' flat' if c['FLATTEN'] else ''}"
    )


def _tuning(tuner) -> dict:
    """The autotuner's last benchmark: every candidate's median ms, the winner, and what the flattened
    loop and TMA each gained (best candidate with the feature vs best without; > 1 means it helped)."""
    timings = getattr(tuner, "configs_timings", None) or {}
    # Triton keeps (median, p20, p80) per candidate (a bare float in some versions); inf = did not run
    ms_by_config = {c: float(t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}
    best = getattr(tuner, "best_config", None)

    def gain(feature: str) -> float | None:
        with_f = [ms for c, ms in ms_by_config.items() if c.kwargs[feature] and ms < float("inf")]
        without = [ms for c, ms in ms_by_config.items() if not c.kwargs[feature] and ms < float("inf")]
        return min(without) / min(with_f) if with_f and without else None

    ranked = sorted(ms_by_config.items(), key=lambda kv: kv[1])
    return {
        "best": _config_name(best) if best is not None else None,
        "flatten_gain": gain("FLATTEN"),
        "tma_gain": gain("USE_TMA"),
        "candidates_ms": {_config_name(c): ms for c, ms in ranked},
    }


def _ratios(tflops: dict, peak: float) -> dict:
    """The issue's ratios; None where a variant failed to run."""
    ours, best = tflops.get("triton"), max(tflops.get("triton", 0.0), tflops.get("triton_no_tma", 0.0))
    # torch._grouped_mm gets the better of its two weight layouts: the comparison is strict for us
    cublas = tflops.get("cublas_dense")
    grouped_mm = max(tflops.get("grouped_mm", 0.0), tflops.get("grouped_mm_ENK", 0.0)) or None
    return {
        "triton_vs_cublas": ours / cublas if ours and cublas else None,
        "triton_vs_grouped_mm": ours / grouped_mm if ours and grouped_mm else None,
        "best_triton_vs_cublas": best / cublas if best and cublas else None,
        "triton_fraction_of_peak": ours / peak if ours else None,
    }


def _fmt(value: float | None, width: int = 8) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'n/a':>{width}}"


def _gemm_line(row: dict) -> str:
    tf, r = row["tflops"], row["ratios"]
    vs_cublas, vs_gmm = r["triton_vs_cublas"], r["triton_vs_grouped_mm"]
    goal_cublas = "n/a" if vs_cublas is None else ("PASS" if vs_cublas >= 0.8 else "MISS")
    goal_gmm = "n/a" if vs_gmm is None else ("PASS" if vs_gmm >= 1.0 else "MISS")
    return (
        f"{row['model']} T={row['T']} {row['gemm']} M={row['M']} K={row['K']} N={row['N']}: TFLOP/s "
        + " ".join(f"{v}={tf[v]:.1f}" for v in tf)
        + f" | x cuBLAS {_fmt(vs_cublas, 0)} ({goal_cublas}) x _grouped_mm {_fmt(vs_gmm, 0)} ({goal_gmm})"
        + f" x peak {_fmt(r['triton_fraction_of_peak'], 0)}"
    )


def _summary(report: dict) -> str:
    lines = [
        "",
        f"== {report['device']} ({report['mode']}): bf16 peak {report['peak']['tflops']:.1f} TFLOP/s ==",
    ]
    names = ("triton", "triton_no_tma", "triton_ENK", "grouped_mm", "cublas_dense")
    lines.append(
        f"{'model':>17} {'T':>6} {'gemm':>7} {'triton':>8} {'no-TMA':>8} {'ENK':>8} {'_grpmm':>8} "
        f"{'cuBLAS':>8}  {'x cuBLAS':>8} {'x _grpmm':>8} {'x peak':>8}   (TFLOP/s)"
    )
    for row in report["gemm"]:
        head = f"{row['model']:>17} {row['T']:>6} {row['gemm']:>7}"
        if "skipped" in row:
            lines.append(f"{head}  skipped ({row['skipped']})")
            continue
        r = row["ratios"]
        cells = " ".join(_fmt(row["tflops"].get(v)) for v in names)
        ratios = " ".join(
            _fmt(r[v]) for v in ("triton_vs_cublas", "triton_vs_grouped_mm", "triton_fraction_of_peak")
        )
        lines.append(f"{head} {cells}  {ratios}")
        graph = row.get("tflops_graph") or {}
        if graph:
            g_cells = ", ".join(f"{v} {graph[v]:.1f}" for v in names if v in graph)
            lines.append(f"{'':>33}graph replay (TFLOP/s): {g_cells}")
        tuned = row.get("tuning", {}).get("triton")
        if tuned:
            lines.append(
                f"{'':>33}best {tuned['best']}; flatten gain {_fmt(tuned['flatten_gain'], 0)}, "
                f"TMA gain {_fmt(tuned['tma_gain'], 0)}"
            )
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    lines.append(f"checks: {len(report['checks']) - len(failed)} ok, {len(failed)} failed {failed[:5]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
