"""The native target's decode and verify forwards, captured once per (rows, tokens) bucket and replayed.

Legend: B block rows, T block tokens, Bb / Tb a bucket's rows / tokens (B <= Bb, T <= Tb), V vocabulary,
D model dim, L cache slots (``max_len``), G query heads per key/value head.

A one-token forward of a small model on a GPU is bound by the host: hundreds of kernel launches and
the Python between them, not the GPU's work (docs/gpu.md).
gpt-fast (``torch.compile`` over a static KV cache) and vLLM (CUDA graphs for its decode batch
sizes) remove that cost by recording the launches once and replaying them. This module does the same
for :class:`specdec.targets.llama.LlamaTarget`, as a transformation of a plain target
(:func:`compile_target` returns a :class:`CompiledTarget` that wraps it):

- a forward whose block fits a bucket (``B <= Bb`` rows, ``T <= Tb`` tokens; the cache's own row
  count is a row bucket too, so a step over every request is one) runs a static-shape
  forward: tokens padded to ``[Bb, Tb]``, attention over all ``L`` cache slots with a mask (so the
  shapes never depend on the rows' lengths), the cache rows given as a tensor;
- each bucket's forward is built once, on first use, and replayed after (:data:`COMPILERS`):
  ``graphs`` records the eager ops into a ``torch.cuda.CUDAGraph``; ``inductor`` compiles them with
  ``torch.compile`` (fused kernels) and, on CUDA, records those into a CUDA graph too;
- anything else runs the wrapped target's own (eager) forward, the reference: trees, prefill chunks
  longer than the largest bucket, blocks too close to the end of the cache to pad, and every
  ``forward_layers`` call.

Padding is exact. A real row's padding tokens sit after its real ones, so causal attention keeps
them out of the real tokens' outputs, and their keys and values land in slots past the row's new
length, which the cache never reads before overwriting (``specdec.targets.kv_cache``). Padding rows
are cache rows outside the block, written at slots past their own lengths; their lengths are not
changed. A block needs ``start + Tb <= L`` on every row it touches, else it runs eagerly.

Numerics: the static forward is the eager one's ops (``LlamaTarget._layer``), attending over all
``L`` slots (the masked ones weigh exactly 0) instead of the written ones, so its matrix products
run over other lengths and may round differently; ``inductor`` also fuses and reorders the
elementwise ops and reductions. Logits agree to float rounding (``tests/test_compiled.py`` holds
them to 1e-4 and the greedy tokens to equality); a row's logits inside one bucket do not depend on
the padding or on the other rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.checks import value_range
from specdec.protocols import TargetOutput
from specdec.targets.kv_cache import block_attention_mask

__all__ = [
    "COMPILE_MODES",
    "COMPILERS",
    "ROW_BUCKETS",
    "TOKEN_BUCKETS",
    "CompiledTarget",
    "compile_target",
]

ROW_BUCKETS = (1, 2, 4, 8, 16)
"""Default row buckets: the engine's batch of requests (vLLM captures its decode batch sizes alike)."""
TOKEN_BUCKETS = (1, 2, 4, 8, 16)
"""Default token buckets: a decode step (1) and verify blocks (γ + 1, or a tree's nodes run eagerly)."""

_Outputs = tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]
_Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], _Outputs]


def _cuda_graph(
    fn: _Forward, inputs: tuple[torch.Tensor, ...], device: torch.device
) -> Callable[[], _Outputs]:
    """Record ``fn(*inputs)`` into a CUDA graph; the replay reads ``inputs`` and writes the returned
    (static) outputs. Two warm-up runs on a side stream first, as ``torch.cuda.graphs`` asks (they
    compile ``inductor`` kernels and write the same keys/values the real call will)."""
    if device.type != "cuda":
        raise ValueError(f"compile='graphs' records CUDA graphs and needs a CUDA target, got device {device}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*inputs)

    def replay() -> _Outputs:
        graph.replay()
        return outputs

    return replay


def _inductor(fn: _Forward, inputs: tuple[torch.Tensor, ...], device: torch.device) -> Callable[[], _Outputs]:
    """``torch.compile`` (inductor, static shapes, one graph); on CUDA its kernels are then recorded into
    a CUDA graph of our own (``_cuda_graph``) rather than by ``mode="reduce-overhead"``, whose graphs
    refuse inputs written in place (the KV cache) unless every such tensor is marked static."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    # Every bucket is one more specialisation of the same code; raise dynamo's per-code limit (8) for
    # the calls that compile (later calls only look their entry up).
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        if device.type == "cuda":
            return _cuda_graph(compiled, inputs, device)
        compiled(*inputs)  # compiles now, not inside the first timed call
    return lambda: compiled(*inputs)


COMPILERS: dict[str, Callable[[_Forward, tuple[torch.Tensor, ...], torch.device], Callable[[], _Outputs]]] = {
    "graphs": _cuda_graph,
    "inductor": _inductor,
}
"""How a bucket's static forward is built and replayed, by name."""
COMPILE_MODES = ("none", *COMPILERS)
"""``compile=`` values: ``none`` (the eager forward), or a :data:`COMPILERS` name."""


@dataclass
class _Bucket:
    """One captured forward: its input buffer (tokens, starts, cache rows, and which bucket rows are the
    block's: one host-to-device copy a call), its host twin (pinned on CUDA), and the replay."""

    ints_N: torch.Tensor
    host_N: torch.Tensor
    tokens_BT: torch.Tensor
    pick_B: torch.Tensor
    copied: Any  # a torch.cuda.Event recorded after the copy out of the pinned buffer (CUDA), or None
    run: Callable[[], _Outputs] | None


def _check_buckets(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    values = tuple(buckets)
    if not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values):
        raise ValueError(f"{name} must be a non-empty sequence of ints >= 1, got {buckets!r}")
    return tuple(sorted(set(values)))


class CompiledTarget:
    """A :class:`specdec.targets.llama.LlamaTarget` whose chain forwards that fit a bucket run captured.

    Everything but :meth:`forward` and :meth:`reset` is the wrapped target's (``target``): its
    config, tokenizer, cache, ``rollback``, ``copy_slots``, ``forward_layers``, ``parts``, ... ``stats``
    counts the forwards that ran captured (``compiled``) and eagerly (``eager``).
    """

    def __init__(
        self,
        target: Any,
        *,
        mode: str = "graphs",
        row_buckets: Sequence[int] = ROW_BUCKETS,
        token_buckets: Sequence[int] = TOKEN_BUCKETS,
    ) -> None:
        from specdec.targets.llama import LlamaTarget

        if mode not in COMPILERS:
            raise ValueError(f"compile mode must be one of {tuple(COMPILERS)}, got {mode!r}")
        if not isinstance(target, LlamaTarget):
            raise ValueError(
                f"compile={mode!r} needs the native target (backend 'llama'), got {type(target).__name__}"
            )
        if target.linear_backend == "packed":
            raise ValueError(
                f"compile={mode!r} captures the PyTorch forward; the target runs the CPU's packed kernels "
                "(load it with linear_backend='reference', the default off the CPU)"
            )
        if mode == "graphs" and target.device.type != "cuda":
            raise ValueError(f"compile='graphs' needs a CUDA target, got device {target.device}")
        self.target = target
        self.mode = mode
        self.row_buckets = _check_buckets("row_buckets", row_buckets)
        self.token_buckets = _check_buckets("token_buckets", token_buckets)
        self.stats = {"compiled": 0, "eager": 0}
        self._buckets: dict[tuple[Any, ...], _Bucket] = {}
        self._cache: Any = None

    def __getattr__(self, name: str) -> Any:
        if name == "target":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.target, name)

    def cost_identity(self) -> dict[str, Any]:
        """The wrapped target's, with how its forwards are captured."""
        return {
            **self.target.cost_identity(),
            "compiled": self.mode,
            "buckets": [list(self.row_buckets), list(self.token_buckets)],
        }

    def reset(self, batch_size: int, max_len: int) -> None:
        """The wrapped target's reset (a new cache, of another shape, drops the captured forwards at the
        next forward)."""
        self.target.reset(batch_size, max_len)

    def forward(
        self,
        tokens_BT: torch.Tensor,
        start_B: torch.Tensor,
        *,
        logits_index_BN: torch.Tensor | None = None,
        tree_mask_TT: torch.Tensor | None = None,
        depth_T: torch.Tensor | None = None,
        rows_B: torch.Tensor | None = None,
    ) -> TargetOutput:
        """:meth:`specdec.targets.llama.LlamaTarget.forward`, captured where the block fits a bucket."""
        t = self.target
        if t.cache is not self._cache:  # reset (here or on the wrapped target) to another cache
            self._buckets.clear()
            self._cache = t.cache
        if tree_mask_TT is not None or depth_T is not None or t.cache is None:
            return self._eager(tokens_BT, start_B, logits_index_BN, tree_mask_TT, depth_T, rows_B)
        checked = self._check(tokens_BT, start_B, rows_B)
        if checked is None:  # not a clean chain block: the eager forward runs it (and names what is wrong)
            return self._eager(tokens_BT, start_B, logits_index_BN, None, None, rows_B)
        tokens_BT, start_B, rows = checked
        B, T = tokens_BT.shape
        index_BN = _check_logits_index(logits_index_BN, B, T)
        plan = self._plan(B, T, start_B, rows)
        if plan is None:
            return self._eager(tokens_BT, start_B, logits_index_BN, None, None, rows_B)
        Bb, Tb, block_rows, pad_rows, pad_starts, whole = plan
        key = (Bb, Tb, whole, tuple(sorted(t.aux_layers)))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _alloc(Bb, Tb, t.device)
        # The block's rows inside the bucket: cache row r at bucket row r (whole), else in order,
        # then the padding rows. One host buffer, one copy to the device.
        order = block_rows if whole else list(range(B))
        if bucket.copied is not None:
            bucket.copied.synchronize()  # the last call's copy out of the pinned buffer (long done)
        host = bucket.host_N
        host.zero_()
        host_tokens_BT, host_start_B, host_rows_B, host_pick_B = _split(host, Bb, Tb)
        on_host = tokens_BT.device.type == "cpu"
        if on_host:
            host_tokens_BT[order, :T] = tokens_BT
        host_pick_B[:B] = torch.tensor(order, dtype=torch.long)
        if whole:
            host_start_B[block_rows] = start_B
            host_start_B[pad_rows] = torch.tensor(pad_starts, dtype=torch.long)
            host_rows_B.copy_(torch.arange(Bb))
        else:
            host_start_B.copy_(torch.cat([start_B, torch.tensor(pad_starts, dtype=torch.long)]))
            host_rows_B.copy_(torch.tensor(block_rows + pad_rows, dtype=torch.long))
        bucket.ints_N.copy_(host, non_blocking=True)
        if bucket.copied is not None:
            bucket.copied.record()
        pick_B = bucket.pick_B[:B]
        with torch.inference_mode():
            if not on_host:  # tokens already on the device: placed there, no round trip
                bucket.tokens_BT[pick_B, :T] = tokens_BT
            if bucket.run is None:  # captured on this call's own inputs: see _capture
                bucket.run = self._capture(bucket, Tb, whole)
            logits_BTV, hidden_BTD, aux = bucket.run()
            # index_select copies: a replay overwrites the captured outputs
            hidden_BTD = hidden_BTD[:, :T].index_select(0, pick_B)
            logits_BTV = logits_BTV[:, :T].index_select(0, pick_B)
            if index_BN is not None:
                idx_BN = index_BN.to(logits_BTV.device)
                logits_BTV = logits_BTV.gather(1, idx_BN[:, :, None].expand(-1, -1, logits_BTV.shape[-1]))
            layers = sorted(t.aux_layers)
            aux_out = {i: a[:, :T].index_select(0, pick_B) for i, a in zip(layers, aux, strict=True)}
        if rows is None:
            t.cache.lengths_B = start_B + T
        else:
            t.cache.lengths_B[rows] = start_B + T
        self.stats["compiled"] += 1
        return TargetOutput(logits_BTV=logits_BTV, hidden_BTD=hidden_BTD, aux_hidden_BTD=aux_out or None)

    # ------------------------------------------------------------------ internals
    def _eager(self, tokens_BT, start_B, logits_index_BN, tree_mask_TT, depth_T, rows_B) -> TargetOutput:
        self.stats["eager"] += 1
        return self.target.forward(
            tokens_BT,
            start_B,
            logits_index_BN=logits_index_BN,
            tree_mask_TT=tree_mask_TT,
            depth_T=depth_T,
            rows_B=rows_B,
        )

    def _check(self, tokens_BT: Any, start_B: Any, rows_B: Any):
        """``(tokens_BT, start_B, rows)`` (long tokens, CPU starts, CPU rows or None) for a valid chain
        block, checked as :meth:`LlamaTarget.forward` checks it; None for anything else, which the
        eager forward then refuses with its own ``ValueError``. Tokens on the CPU are checked there and
        never copied to the device alone (a copy from pageable memory waits for the device)."""
        t = self.target
        cache = t.cache
        if not isinstance(tokens_BT, torch.Tensor) or tokens_BT.ndim != 2 or tokens_BT.shape[1] < 1:
            return None
        if tokens_BT.dtype not in (torch.long, torch.int32):
            return None
        if tokens_BT.device.type != "cpu":  # already on the device: the target's own check
            tokens_BT, start_B, rows = t._check_block(tokens_BT, start_B, None, None, rows_B=rows_B)
            return tokens_BT.long(), start_B, rows
        B, T = tokens_BT.shape
        rows = None if rows_B is None else t._check_rows(rows_B, B)
        if rows is None and B != cache.batch_size:
            return None
        start_B = torch.as_tensor(start_B, dtype=torch.long).reshape(-1).cpu()
        if start_B.shape[0] != B:
            return None
        held = cache.lengths_B.tolist()
        held = held if rows is None else [held[r] for r in rows.tolist()]
        if any(s < 0 or s + T > cache.max_len or s > h for s, h in zip(start_B.tolist(), held, strict=True)):
            return None
        lo, hi = value_range(tokens_BT)
        if lo < 0 or hi >= t.vocab_size:
            return None
        return tokens_BT.long(), start_B, rows

    def _plan(self, B: int, T: int, start_B: torch.Tensor, rows: torch.Tensor | None):
        """The bucket for a block of B rows and T tokens, and its padding rows; None: run it eagerly."""
        cache = self.target.cache
        L, C = cache.max_len, cache.batch_size
        Tb = next((b for b in self.token_buckets if b >= T), None)
        Bb = next((b for b in (*self.row_buckets, C) if B <= b <= C), None)  # C: the whole cache
        if Tb is None or Bb is None:
            return None
        block_rows = list(range(C)) if rows is None else rows.tolist()
        if any(s + Tb > L for s in start_B.tolist()):
            return None
        taken, lengths = set(block_rows), cache.lengths_B.tolist()
        spare = [r for r in range(C) if r not in taken and lengths[r] + Tb <= L]
        if len(spare) < Bb - B:
            return None
        pad_rows = spare[: Bb - B]
        pad_starts = [lengths[r] for r in pad_rows]
        return Bb, Tb, block_rows, pad_rows, pad_starts, Bb == C

    def _capture(self, bucket: _Bucket, Tb: int, whole: bool) -> Callable[[], _Outputs]:
        """Capture (or compile) a bucket's forward on its input buffer. Capturing runs the forward on
        the buffer's contents, the real call's inputs: it writes the keys/values the real call writes,
        at the same slots, and nothing else."""
        t = self.target
        fn = _static_forward(t, Tb, whole, tuple(sorted(t.aux_layers)))
        inputs = _split(bucket.ints_N, *bucket.tokens_BT.shape)[:3]
        return COMPILERS[self.mode](fn, inputs, t.device)


def _alloc(Bb: int, Tb: int, device: torch.device) -> _Bucket:
    """A bucket's input buffer on ``device`` and its host twin (pinned on CUDA), not yet captured."""
    host_N = torch.zeros(Bb * Tb + 3 * Bb, dtype=torch.long)
    cuda = device.type == "cuda"
    if cuda:
        host_N = host_N.pin_memory()
    ints_N = torch.zeros(host_N.shape, dtype=torch.long, device=device)
    tokens_BT, _, _, pick_B = _split(ints_N, Bb, Tb)
    return _Bucket(ints_N, host_N, tokens_BT, pick_B, torch.cuda.Event() if cuda else None, None)


def _split(ints_N: torch.Tensor, Bb: int, Tb: int) -> tuple[torch.Tensor, ...]:
    """A bucket's input buffer as views: tokens ``[Bb, Tb]``, starts, cache rows and output picks ``[Bb]``."""
    n = Bb * Tb
    return ints_N[:n].view(Bb, Tb), ints_N[n : n + Bb], ints_N[n + Bb : n + 2 * Bb], ints_N[n + 2 * Bb :]


def _static_forward(target: Any, Tb: int, whole: bool, aux_layers: tuple[int, ...]) -> _Forward:
    """The target's forward at a fixed shape: ``fn(tokens_BT, start_B, rows_B) -> (logits_BTV,
    hidden_BTD, aux outputs)``, every layer through the target's own ``_layer``, attending over all L
    slots of the cache. ``whole``: the bucket's rows are the cache's rows in order (no gather)."""
    c, cache = target.config, target.cache
    L, G = cache.max_len, c.num_heads // c.num_kv_heads
    wanted = frozenset(aux_layers)

    def fn(tokens_BT: torch.Tensor, start_B: torch.Tensor, rows_B: torch.Tensor) -> _Outputs:
        positions_BT = start_B[:, None] + torch.arange(Tb, device=start_B.device)
        cos_BT1E, sin_BT1E = target._cos[positions_BT][:, :, None], target._sin[positions_BT][:, :, None]
        causal_TT = torch.ones(Tb, Tb, dtype=torch.bool, device=start_B.device).tril()
        # the G query heads of a key/value head are stacked as G·Tb rows, as in LlamaTarget._run
        mask = block_attention_mask(start_B, L, causal_TT).repeat(1, 1, G, 1)
        x_BTD = target.embed_tokens.weight[tokens_BT]
        aux = []
        for i in range(c.num_layers):
            x_BTD = target._layer(
                i, x_BTD, cos_BT1E, sin_BT1E, start_B, None, L, mask, None if whole else rows_B
            )
            if i in wanted:
                aux.append(x_BTD)
        return target._head(x_BTD), x_BTD, tuple(aux)

    return fn


def _check_logits_index(logits_index_BN: Any, B: int, T: int) -> torch.Tensor | None:
    if logits_index_BN is None:
        return None
    idx = torch.as_tensor(logits_index_BN, dtype=torch.long)
    if idx.ndim != 2 or idx.shape[0] != B or (idx < 0).any() or (idx >= T).any():
        raise ValueError(f"logits_index_BN must be [B, N] with entries in [0, {T}), got {tuple(idx.shape)}")
    return idx


def compile_target(
    target: Any,
    mode: str = "graphs",
    *,
    row_buckets: Sequence[int] = ROW_BUCKETS,
    token_buckets: Sequence[int] = TOKEN_BUCKETS,
) -> Any:
    """``target`` with its bucketed forwards captured (:class:`CompiledTarget`); ``mode="none"`` returns
    ``target`` itself. ``ValueError`` for an unknown mode, a target that is not the native one, the
    CPU's packed kernels, or ``graphs`` off CUDA."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "none":
        return target
    return CompiledTarget(target, mode=mode, row_buckets=row_buckets, token_buckets=token_buckets)
