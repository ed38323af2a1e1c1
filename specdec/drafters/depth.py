"""How deep to draft, from costs measured on the machine that runs: the default drafter's controller.

Legend: K tokens drafted in a step, T = K + 1 the verify block, a_k the chance that draft position k
is accepted given that every earlier one was.

A step that drafts K tokens costs ``K · t_draft + t_verify(K + 1)`` and yields on average
``E(K) = 1 + a_1 + a_1 a_2 + … + a_1…a_K`` tokens (Leviathan et al. 2023, arXiv 2211.17192, §3.4,
with per-position acceptance and the verify cost measured per block length instead of assumed
flat). :class:`DepthController` drafts the K in ``0..γ`` that maximises ``E(K) / cost(K)``; K = 0 is
a plain decode step, so on a machine where a verify block costs more than the tokens it brings,
speculation switches itself off.

- ``t_verify(T)`` is measured when the drafter starts on a target (:meth:`DepthController.calibrate`:
  a few timed forwards of T = 1..max tokens right after the prefill, rolled back) and then
  followed online (an exponential moving average of each step's time from the end of ``propose``
  to ``observe``: the forward, verification and commit of that block);
- ``t_draft`` and the ``a_k`` are measured online (acceptances decay, so they follow the text;
  ``a_k`` starts at a prior worth a few steps).

Exactness does not depend on any of it: the depth is chosen before the draft, from costs and past
acceptances, and verification is exact for any proposal.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from specdec.policies import interpolate_block_cost

__all__ = ["DepthController"]


class DepthController:
    """Chooses the draft depth of each step from measured costs (see the module doc)."""

    def __init__(
        self,
        *,
        max_block: int = 9,
        prior: float = 0.6,
        prior_weight: float = 3.0,
        decay: float = 0.97,
        ema: float = 0.2,
        repeats: int = 2,
    ) -> None:
        if max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {max_block}")
        self.max_block, self.prior, self.prior_weight = max_block, prior, prior_weight
        self.decay, self.ema, self.repeats = decay, ema, repeats
        self.t_verify: dict[int, float] = {}
        self.t_draft: float | None = None
        self.accepted = [0.0] * max_block  # decayed counts per draft position (1-based k -> index k-1)
        self.reached = [0.0] * max_block
        self.calibrated_for: tuple[int, int] | None = None  # (id of the target, batch size)
        self._step: tuple[int, float, float] | None = None  # (K, draft seconds, end of propose)

    # --- estimates --------------------------------------------------------------------------------
    def accept_rate(self, k: int) -> float:
        """a_k: the chance that draft position k (1-based) is accepted when reached."""
        i = k - 1
        return (self.accepted[i] + self.prior * self.prior_weight) / (self.reached[i] + self.prior_weight)

    def verify_cost(self, T: int) -> float:
        """t_verify(T), interpolated (and extrapolated linearly) from the measured block lengths."""
        return interpolate_block_cost(self.t_verify, T, above="linear")

    def expected_tokens(self, K: int) -> float:
        """E(K): tokens a step that drafts K yields (the bonus or recovered token included)."""
        total, reach = 1.0, 1.0
        for k in range(1, K + 1):
            reach *= self.accept_rate(k)
            total += reach
        return total

    def rate(self, K: int) -> float:
        """Expected tokens per second of a step that drafts K tokens."""
        cost = K * (self.t_draft or 0.0) + self.verify_cost(K + 1)
        return self.expected_tokens(K) / cost if cost > 0 else float("inf")

    def depth(self, gamma: int) -> int:
        """The K in 0..min(γ, max_block - 1) with the best expected rate (ties: the shorter)."""
        top = max(0, min(gamma, self.max_block - 1))
        return max(range(top + 1), key=lambda K: (self.rate(K), -K))

    # --- measurement ------------------------------------------------------------------------------
    @torch.inference_mode()
    def calibrate(self, target: Any, state: Any) -> None:
        """Time forwards of T = 1..max_block tokens at the rows' current positions (once per target
        and batch size), each rolled back; keeps the fastest of ``repeats`` runs per T."""
        key = (id(target), state.batch_size)
        if self.calibrated_for == key:
            return
        start_B = state.lengths_B - 1
        room = int(state.tokens_BL.shape[1] - state.lengths_B.max())
        last = state.last_tokens_B()
        for T in range(1, min(self.max_block, room) + 1):
            block = last.unsqueeze(1).repeat(1, T)
            best = float("inf")
            for _ in range(self.repeats + 1):  # the first run of each T warms caches and allocators
                t0 = time.perf_counter()
                target.forward(block, start_B)
                best = min(best, time.perf_counter() - t0)
                target.rollback(start_B)
            self.t_verify[T] = best
        self.calibrated_for = key

    def drafted(self, K: int, draft_s: float, *, learn: bool = True) -> None:
        """``propose`` drafted K tokens in ``draft_s`` seconds (the verify timer starts now);
        ``learn=False``: time the block, but do not count its acceptances or draft cost (a step
        that another drafter proposed)."""
        self._step = (K if learn else -K - 1, draft_s, time.perf_counter())

    def verified(self, num_accepted: list[int]) -> None:
        """``observe``: the step's verify time and acceptances (per running row)."""
        if self._step is None:
            return
        K, draft_s, t_end = self._step
        self._step = None
        learn = K >= 0
        K = K if learn else -K - 1
        T = K + 1
        t_verify = time.perf_counter() - t_end
        old = self.t_verify.get(T)
        self.t_verify[T] = t_verify if old is None else old + self.ema * (t_verify - old)
        if K == 0 or not num_accepted or not learn:
            return
        per_token = draft_s / K
        self.t_draft = (
            per_token if self.t_draft is None else self.t_draft + self.ema * (per_token - self.t_draft)
        )
        self.accepted = [a * self.decay for a in self.accepted]
        self.reached = [r * self.decay for r in self.reached]
        for a in num_accepted:
            for k in range(1, min(K, a + 1) + 1):  # positions 1..a accepted, a + 1 reached and rejected
                self.reached[k - 1] += 1
                self.accepted[k - 1] += k <= a
