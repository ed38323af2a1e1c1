"""The exact law of one verify call, read off the real verifier by probing.

Legend: B rows, K draft length (γ), V vocabulary, R probe rows (B × positions).

Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1); Chen et al. 2023 (arXiv 2302.01318).

**Probing, not re-deriving.** :func:`verifier_step_law` does not restate the acceptance rule: it runs
``verify_fn`` (by default the real :func:`specdec.verify.rejection_sample`) on chosen randomness and
reads off its exact law. A chain rejection sampler consumes two kinds of randomness: a uniform
``u_k`` per draft position and one categorical draw for the recovered or bonus token. A keyed
verifier (``noise=``, like the product's rules) draws the uniforms with ``noise.uniform_BK`` and the
token with ``specdec.verify.noise.sample_with_keys``; one with the generator signature (a third
party's) with ``torch.rand`` and ``specdec.sampling.sample_from_probs``. While probing, the noise is
a probe and the token sampler's name is replaced *in verify_fn's own module*:

- the uniforms are ones we choose. Position k's acceptance probability t_k is the length of
  the set of u that accept; it is found by bisection on u (64 halvings: error < 1e-18), with earlier
  positions forced to accept (u = 0), and checked on random u to be a threshold (accept iff u < t_k).
- the token sampler records the weights it is given (their normalisation is the law of the drawn
  token) and returns a sentinel id; two sentinels locate where the drawn token lands in the output.

A path "accept n drafts, then stop" has probability t_0 ⋯ t_{n−1} (1 − t_n) (no last factor when
n = K). Everything is computed by verify_fn itself, in the dtype it is given: pass float64 inputs to
get float64 probabilities (the exact tests compare them to the target to 1e-12).

Limits: probing patches module globals for the duration of a call (not thread-safe), and needs a
verifier written in that style; any other verifier raises :class:`ProbeError` here and can still be
tested by Monte-Carlo (:func:`specdec.testing.sample_output_distribution`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specdec.testing.keyed import is_keyed
from specdec.verify import rejection_sample
from specdec.verify.noise import PositionNoise

__all__ = ["ProbeError", "StepOutcome", "VerifyFn", "verifier_step_law"]

VerifyFn = Callable[..., Any]
"""Signature of :func:`specdec.verify.rejection_sample`; returns ``(tokens [B, K+1], num_accepted [B])``."""

_BELOW_ONE = 1.0 - 2.0**-53  # the largest float64 below 1 (torch.rand's range is [0, 1))


class ProbeError(ValueError):
    """``verify_fn`` cannot be evaluated exactly by probing (see the module doc)."""


@dataclass(frozen=True)
class StepOutcome:
    """One accept/reject path of a verify call for one row.

    ``probability``: of the path. ``tokens``: what the row emits (tokens before the first -1);
    ``None`` marks the token drawn from ``stop_probs`` (float64 ``[V]``). ``stop_probs`` is None when
    the drawn token is not emitted. ``num_accepted``: what verify_fn reported for the path.
    """

    probability: float
    tokens: tuple[int | None, ...]
    stop_probs: torch.Tensor | None
    num_accepted: int

    def emitted(self) -> dict[tuple[int, ...], float]:
        """Distribution of the emitted token tuple on this path (probabilities sum to ``probability``)."""
        if self.stop_probs is None:
            return {tuple(int(t) for t in self.tokens): self.probability}  # type: ignore[arg-type]
        out = {}
        i = self.tokens.index(None)
        for y in torch.nonzero(self.stop_probs > 0).flatten().tolist():
            seq = self.tokens[:i] + (y,) + self.tokens[i + 1 :]
            out[seq] = self.probability * float(self.stop_probs[y])
        return out  # type: ignore[return-value]


class _TorchWithFixedRand:
    """Stands in for the ``torch`` module inside verify_fn's module: ``rand`` returns chosen uniforms."""

    def __init__(self, u_RK: torch.Tensor, log: dict) -> None:
        self._u_RK = u_RK
        self._log = log

    def rand(self, *size: Any, **kwargs: Any) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        if tuple(int(s) for s in shape) != tuple(self._u_RK.shape):
            raise ProbeError(
                f"verify_fn drew uniforms of shape {tuple(shape)}; probing expects one torch.rand of shape "
                f"[B, K] = {tuple(self._u_RK.shape)}"
            )
        self._log["rand"] += 1
        return self._u_RK.clone()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _ProbeNoise(PositionNoise):
    """Keyed noise whose acceptance uniforms are chosen ones (a keyed verifier's ``uniform_BK``)."""

    def __init__(self, u_RK: torch.Tensor, log: dict) -> None:
        super().__init__(torch.zeros(u_RK.shape[0], dtype=torch.int64))
        self._fixed_rand = _TorchWithFixedRand(u_RK, log)

    def uniform_BK(self, positions_BK: torch.Tensor, stream: str, **kwargs: Any) -> torch.Tensor:
        return self._fixed_rand.rand(positions_BK.shape).to(kwargs.get("dtype", torch.float64))


class _Probe:
    """Runs verify_fn with chosen uniforms and a recording, sentinel-returning token sampler."""

    def __init__(self, verify_fn: VerifyFn) -> None:
        fn = inspect.unwrap(verify_fn)
        module_globals = getattr(fn, "__globals__", None)
        self.keyed = is_keyed(verify_fn)
        self.sampler = "sample_with_keys" if self.keyed else "sample_from_probs"
        if module_globals is None or self.sampler not in module_globals or "torch" not in module_globals:
            raise ProbeError(
                f"{getattr(verify_fn, '__name__', verify_fn)!r} cannot be enumerated exactly: probing needs "
                "a Python function whose module draws the recovered/bonus token with "
                "specdec.verify.noise.sample_with_keys (keyed) or specdec.sampling.sample_from_probs (and "
                "uniforms with torch.rand); test it with sample_output_distribution instead"
            )
        self.verify_fn = verify_fn
        self.module_globals = module_globals

    def run(
        self,
        target_probs_RKV: torch.Tensor,
        draft_tokens_RK: torch.Tensor,
        draft_probs_RKV: torch.Tensor | None,
        u_RK: torch.Tensor,
        sentinel: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        log: dict = {"rand": 0, "weights": []}
        R = target_probs_RKV.shape[0]

        def record(probs: torch.Tensor, generator: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
            log["weights"].append(probs.detach().double().reshape(-1, probs.shape[-1]).clone())
            return torch.full(probs.shape[:-1], sentinel, dtype=torch.long, device=probs.device)

        g = self.module_globals
        saved = g["torch"], g[self.sampler]
        if self.keyed:
            K1 = target_probs_RKV.shape[1]
            randomness = {
                "noise": _ProbeNoise(u_RK, log),
                "positions_BK": torch.zeros((R, K1), dtype=torch.long),
            }
            g[self.sampler] = record
        else:
            randomness = {"generator": None}
            g["torch"], g[self.sampler] = _TorchWithFixedRand(u_RK, log), record
        try:
            tokens, num_accepted = self.verify_fn(
                target_probs_RKV, draft_tokens_RK, draft_probs_RKV, **randomness
            )
        finally:
            g["torch"], g[self.sampler] = saved
        if log["rand"] > 1 or len(log["weights"]) != 1 or log["weights"][0].shape[0] != R:
            raise ProbeError(
                f"verify_fn drew uniforms {log['rand']} times and called {self.sampler} "
                f"{len(log['weights'])} times; probing expects at most one [B, K] uniform draw and exactly "
                "one [B, V] token draw"
            )
        return tokens.long().cpu(), num_accepted.long().cpu(), log["weights"][0].cpu()


def _emitted_length(tokens_RK1: torch.Tensor) -> torch.Tensor:
    """Tokens before the first -1 in each row."""
    padding = tokens_RK1 < 0
    return torch.where(padding.any(-1), padding.float().argmax(-1), tokens_RK1.shape[1])


def _acceptance_thresholds(
    probe: _Probe,
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    bisection_steps: int,
) -> torch.Tensor:
    """float64 ``[B, K]``: P(position k accepted | positions < k accepted), by bisection on u_k."""
    B, K = draft_tokens_BK.shape
    R = B * K
    target_R = target_probs_BKV.repeat_interleave(K, 0)
    tokens_R = draft_tokens_BK.repeat_interleave(K, 0)
    draft_R = None if draft_probs_BKV is None else draft_probs_BKV.repeat_interleave(K, 0)
    pos_R = torch.arange(K).repeat(B)
    rows_R = torch.arange(R)

    def accepts(u_R: torch.Tensor) -> torch.Tensor:
        u_RK = torch.zeros((R, K), dtype=torch.float64)  # u = 0 before k: accept whatever can be accepted
        u_RK[rows_R, pos_R] = u_R
        _, num_accepted_R, _ = probe.run(target_R, tokens_R, draft_R, u_RK, sentinel=0)
        return num_accepted_R > pos_R

    accept_at_zero = accepts(torch.zeros(R, dtype=torch.float64))
    accept_below_one = accepts(torch.full((R,), _BELOW_ONE, dtype=torch.float64))
    if (accept_below_one & ~accept_at_zero).any():
        raise ProbeError("verify_fn accepts a large uniform but rejects u = 0: not a threshold rule (u < t)")
    lo = torch.zeros(R, dtype=torch.float64)
    hi = torch.ones(R, dtype=torch.float64)
    for _ in range(bisection_steps):
        mid = (lo + hi) / 2
        a = accepts(mid)
        lo, hi = torch.where(a, mid, lo), torch.where(a, hi, mid)
    t_R = torch.where(accept_below_one, 1.0, torch.where(accept_at_zero, (lo + hi) / 2, 0.0))
    # The acceptance set must be the interval [0, t): check it on random uniforms.
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        u_R = torch.rand(R, dtype=torch.float64, generator=g)
        clear = (u_R - t_R).abs() > 1e-12
        if ((accepts(u_R) != (u_R < t_R)) & clear).any():
            raise ProbeError("verify_fn's acceptance is not a threshold in its uniform (accept iff u < t)")
    return t_R.reshape(B, K)


def verifier_step_law(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None = None,
    *,
    verify_fn: VerifyFn = rejection_sample,
    bisection_steps: int = 64,
) -> list[list[StepOutcome]]:
    """The exact law of one verify call, per row, read off ``verify_fn`` by probing (module doc).

    Arguments are those of :func:`specdec.verify.rejection_sample` (the draft tokens are fixed here).
    Returns, per row, the reachable accept/reject paths as :class:`StepOutcome` (probabilities sum
    to 1).
    """
    if target_probs_BKV.ndim != 3 or draft_tokens_BK.ndim != 2:
        raise ValueError("target_probs_BKV must be [B, K+1, V] and draft_tokens_BK [B, K]")
    B, K1, V = target_probs_BKV.shape
    K = K1 - 1
    if tuple(draft_tokens_BK.shape) != (B, K):
        raise ValueError(f"draft_tokens_BK must have shape [{B}, {K}], got {tuple(draft_tokens_BK.shape)}")
    probe = _Probe(verify_fn)
    # Identical input rows have identical laws: probe each distinct row once.
    features = [target_probs_BKV.reshape(B, -1).double(), draft_tokens_BK.double()]
    if draft_probs_BKV is not None:
        features.append(draft_probs_BKV.reshape(B, -1).double())
    _, inverse_B = torch.unique(torch.cat(features, dim=1), dim=0, return_inverse=True)
    U = int(inverse_B.max()) + 1 if B else 0
    first_U = torch.full((U,), B, dtype=torch.long).scatter_reduce_(0, inverse_B, torch.arange(B), "amin")
    laws_U = _distinct_rows_law(
        probe,
        target_probs_BKV[first_U],
        draft_tokens_BK[first_U],
        None if draft_probs_BKV is None else draft_probs_BKV[first_U],
        bisection_steps,
    )
    return [laws_U[u] for u in inverse_B.tolist()]


def _distinct_rows_law(
    probe: _Probe,
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    bisection_steps: int,
) -> list[list[StepOutcome]]:
    B, K1, V = target_probs_BKV.shape
    K = K1 - 1
    t_BK = (
        _acceptance_thresholds(probe, target_probs_BKV, draft_tokens_BK, draft_probs_BKV, bisection_steps)
        if K > 0
        else torch.zeros((B, 0), dtype=torch.float64)
    )

    # One probe row per (row b, number of accepted drafts n).
    R = B * (K + 1)
    n_R = torch.arange(K + 1).repeat(B)
    b_R = torch.arange(B).repeat_interleave(K + 1)
    t_padded_BK1 = torch.cat([t_BK, torch.zeros((B, 1), dtype=torch.float64)], dim=1)  # n = K never rejects
    prefix_B_K1 = torch.cat([torch.ones((B, 1), dtype=torch.float64), torch.cumprod(t_BK, dim=1)], dim=1)
    path_R = prefix_B_K1[b_R, n_R] * (1.0 - t_padded_BK1[b_R, n_R])
    positions_RK = torch.arange(K).expand(R, K)
    u_RK = torch.zeros((R, K), dtype=torch.float64)
    rejecting = (n_R < K).nonzero().flatten()
    u_RK[rejecting, n_R[rejecting]] = (1.0 + t_padded_BK1[b_R, n_R][rejecting]) / 2  # rejects when t < 1
    later_RK = positions_RK > n_R.unsqueeze(1)
    args = (
        target_probs_BKV.repeat_interleave(K + 1, 0),
        draft_tokens_BK.repeat_interleave(K + 1, 0),
        None if draft_probs_BKV is None else draft_probs_BKV.repeat_interleave(K + 1, 0),
    )
    tokens_a, accepted_a, weights_a = probe.run(*args, u_RK, sentinel=0)
    # Second run: other uniforms after the stop position, other sentinel. A chain verifier's output
    # must not depend on the former; the latter shows where the drawn token lands.
    u_b_RK = torch.where(later_RK, _BELOW_ONE, u_RK)
    tokens_b, accepted_b, weights_b = probe.run(*args, u_b_RK, sentinel=V - 1)

    len_a, len_b = _emitted_length(tokens_a), _emitted_length(tokens_b)
    laws: list[list[StepOutcome]] = [[] for _ in range(B)]
    for r in range(R):
        p = float(path_R[r])
        if p <= 0.0:
            continue
        n = int(n_R[r])
        if int(accepted_a[r]) != int(accepted_b[r]) or int(len_a[r]) != int(len_b[r]):
            raise ProbeError(f"verify_fn's output after {n} accepted drafts depends on later uniforms")
        if not torch.equal(weights_a[r], weights_b[r]):
            raise ProbeError("the drawn token's distribution depends on uniforms after the stop position")
        row_a = tokens_a[r, : int(len_a[r])].tolist()
        row_b = tokens_b[r, : int(len_b[r])].tolist()
        differ = [i for i, (x, y) in enumerate(zip(row_a, row_b, strict=True)) if x != y]
        if V == 1 or not differ:  # the drawn token is fixed (V = 1) or not emitted
            stop_probs, tokens = None, tuple(row_a)
        elif len(differ) == 1 and row_a[differ[0]] == 0 and row_b[differ[0]] == V - 1:
            total = float(weights_a[r].sum())
            if not total > 0.0:
                raise ProbeError(f"verify_fn samples the stop token from a row with no mass (path n={n})")
            stop_probs = weights_a[r] / total
            tokens = tuple(None if i == differ[0] else t for i, t in enumerate(row_a))
        else:
            raise ProbeError(f"cannot locate the drawn token in verify_fn's output {row_a} / {row_b}")
        laws[int(b_R[r])].append(StepOutcome(p, tokens, stop_probs, int(accepted_a[r])))
    return laws
