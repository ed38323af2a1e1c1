"""Gamma policies: how many tokens to draft at each step.

Legend: B batch, K tokens actually drafted in a step (≤ γ), T target block length (K + 1).

A policy is asked for γ before each step (:meth:`GammaPolicy.next_gamma`) and told what happened
after it (:meth:`GammaPolicy.update`). Policies are looked up by name in :data:`POLICIES`
(``fixed``, ``heuristic``, ``cost``); third-party ones register there or through the
``specdec.gamma_policies`` entry-point group. γ never changes *what* is generated (verification is
exact for any proposal), only how fast.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from specdec.metrics import StepStats, expected_tokens_per_step
from specdec.protocols import DecodeState
from specdec.registry import Registry

__all__ = [
    "StepStats",
    "GammaPolicy",
    "FixedGamma",
    "HeuristicGamma",
    "CostModelGamma",
    "POLICIES",
    "make_policy",
    "as_policy",
    "interpolate_block_cost",
]


@runtime_checkable
class GammaPolicy(Protocol):
    """Chooses the draft length γ of each step."""

    max_gamma: int
    """Upper bound on any γ this policy returns (the loop sizes caches with it)."""

    def next_gamma(self, state: DecodeState) -> int:
        """γ for the next step (0 means a plain decode step)."""
        ...

    def update(self, stats: StepStats) -> None:
        """Learn from the step that just ran."""
        ...


def interpolate_block_cost(costs: dict[int, float], T: int, *, above: str = "flat") -> float:
    """Target time of a T-token block from measured ``costs`` (block length -> seconds): the
    measurement, else linear between the measured neighbours, else proportional to T below the
    shortest measured block. Above the longest: ``"flat"`` (its cost: optimistic, so an untried
    length gets tried once) or ``"linear"`` (the slope of the last two; proportional to T with one).
    No measurement at all: T (one unit per token)."""
    if T in costs:
        return costs[T]
    if not costs:
        return float(T)
    known = sorted(costs)
    lower = [t for t in known if t < T]
    upper = [t for t in known if t > T]
    if lower and upper:
        lo, hi = lower[-1], upper[0]
        return costs[lo] + (costs[hi] - costs[lo]) * (T - lo) / (hi - lo)
    if lower and above == "flat":
        return costs[lower[-1]]
    if len(lower) >= 2:
        a, b = lower[-2], lower[-1]
        return costs[b] + (costs[b] - costs[a]) / (b - a) * (T - b)
    return costs[known[0]] * T / known[0]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class FixedGamma:
    """Always γ."""

    def __init__(self, gamma: int = 4) -> None:
        self.gamma = _check_int("gamma", gamma, 0)
        self.max_gamma = self.gamma

    def next_gamma(self, state: DecodeState) -> int:
        return self.gamma

    def update(self, stats: StepStats) -> None:
        pass

    def __repr__(self) -> str:
        return f"FixedGamma({self.gamma})"


class HeuristicGamma:
    """The ``transformers`` assisted-generation heuristic: γ += 2 when every draft of every running
    row was accepted, else γ −= 1, never below 1 (``num_assistant_tokens_schedule="heuristic"``)."""

    def __init__(self, gamma: int = 4, *, max_gamma: int | None = None) -> None:
        """``gamma``: the starting γ; ``max_gamma``: cap (default ``max(16, gamma)``)."""
        _check_int("gamma", gamma, 1)
        self.max_gamma = _check_int("max_gamma", max(16, gamma) if max_gamma is None else max_gamma, 1)
        self.gamma = min(gamma, self.max_gamma)

    def next_gamma(self, state: DecodeState) -> int:
        return self.gamma

    def update(self, stats: StepStats) -> None:
        if not stats.num_accepted:
            return
        if stats.gamma > 0 and min(stats.num_accepted) >= stats.max_accept >= stats.gamma:
            self.gamma = min(self.gamma + 2, self.max_gamma)
        else:
            self.gamma = max(1, self.gamma - 1)

    def __repr__(self) -> str:
        return f"HeuristicGamma(gamma={self.gamma}, max_gamma={self.max_gamma})"


class CostModelGamma:
    """Pick γ that maximises expected tokens per second under measured costs.

    For each γ in ``0..max_gamma`` it scores ``τ_expected(α̂, γ) / (γ·t_draft + t_verify(γ+1))``
    (Leviathan et al. 2023, arXiv 2211.17192, §3.4 with the verify cost measured per block length
    instead of assumed flat) and takes the best; γ = 0 (a plain decode step, no drafting) wins when
    drafts are too expensive or too often rejected.

    - α̂ is the per-token acceptance probability of the i.i.d. model, estimated as accepted /
      (accepted + rejections) with exponential forgetting (``decay``) and a prior of
      ``alpha_prior`` worth ``prior_weight`` trials.
    - ``t_draft`` (per drafted token) and ``t_verify(T)`` (per block length T) are exponential moving
      averages of measured times. An unmeasured T is interpolated between measured neighbours;
      outside them it is estimated optimistically (flat above, proportional to T below), so an
      untried γ gets tried once and then measured.
    - After ``probe_every`` consecutive γ = 0 steps it drafts once with the best γ ≥ 1 so that α̂
      and t_draft follow changes in the text.
    """

    def __init__(
        self,
        gamma: int = 4,
        *,
        max_gamma: int | None = None,
        alpha_prior: float = 0.6,
        prior_weight: float = 4.0,
        decay: float = 0.98,
        ema: float = 0.2,
        probe_every: int = 32,
    ) -> None:
        """``gamma``: γ of the first step (before anything is measured); ``max_gamma``: the largest γ
        considered (default ``max(8, gamma)``); the rest is described in the class doc."""
        _check_int("gamma", gamma, 0)
        self.max_gamma = _check_int("max_gamma", max(8, gamma) if max_gamma is None else max_gamma, 1)
        self.initial_gamma = min(gamma, self.max_gamma)
        if not 0.0 <= alpha_prior <= 1.0:
            raise ValueError(f"alpha_prior must lie in [0, 1], got {alpha_prior!r}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must lie in (0, 1], got {decay!r}")
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"ema must lie in (0, 1], got {ema!r}")
        self.alpha_prior = alpha_prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.ema = ema
        self.probe_every = _check_int("probe_every", probe_every, 1)
        self.accepted = 0.0  # decayed Σ accepted drafts
        self.trials = 0.0  # decayed Σ (accepted + rejections)
        self.t_draft: float | None = None  # seconds per drafted token
        self.t_verify: dict[int, float] = {}  # block length T -> seconds
        self.zero_streak = 0

    # --- estimates -----------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        """Current estimate α̂ of the per-token acceptance probability."""
        return (self.accepted + self.alpha_prior * self.prior_weight) / (self.trials + self.prior_weight)

    def verify_cost(self, T: int) -> float:
        """Estimated target time for a block of T tokens (see the class doc)."""
        return interpolate_block_cost(self.t_verify, T, above="flat")

    def expected_rate(self, gamma: int) -> float:
        """Expected tokens per second of a step with this γ, under the current estimates."""
        t_draft = self.t_draft if self.t_draft is not None else 0.0
        cost = gamma * t_draft + self.verify_cost(gamma + 1)
        return expected_tokens_per_step(self.alpha, gamma) / cost if cost > 0 else float("inf")

    # --- policy ---------------------------------------------------------------------------------
    def next_gamma(self, state: DecodeState) -> int:
        if not self.t_verify:
            return self.initial_gamma
        rates = [self.expected_rate(g) for g in range(self.max_gamma + 1)]
        best = max(range(self.max_gamma + 1), key=lambda g: (rates[g], -g))
        if best == 0:
            self.zero_streak += 1
            if self.zero_streak > self.probe_every:
                self.zero_streak = 0
                return max(range(1, self.max_gamma + 1), key=lambda g: (rates[g], -g))
        else:
            self.zero_streak = 0
        return best

    def update(self, stats: StepStats) -> None:
        T = stats.num_drafted + 1
        old = self.t_verify.get(T)
        self.t_verify[T] = (
            stats.verify_time_s if old is None else old + self.ema * (stats.verify_time_s - old)
        )
        if stats.num_drafted > 0 and stats.num_accepted:
            per_token = stats.draft_time_s / stats.num_drafted
            self.t_draft = (
                per_token if self.t_draft is None else self.t_draft + self.ema * (per_token - self.t_draft)
            )
            accepted = sum(stats.num_accepted)
            rejections = sum(1 for a in stats.num_accepted if a < stats.max_accept)
            self.accepted = self.decay * self.accepted + accepted
            self.trials = self.decay * self.trials + accepted + rejections

    def __repr__(self) -> str:
        return f"CostModelGamma(max_gamma={self.max_gamma}, alpha={self.alpha:.3f}, t_draft={self.t_draft})"


POLICIES = Registry(
    "gamma-policy name",
    "specdec.gamma_policies",
    builtins={
        "fixed": "specdec.policies:FixedGamma",
        "heuristic": "specdec.policies:HeuristicGamma",
        "cost": "specdec.policies:CostModelGamma",
    },
)


def make_policy(name: str, **options: Any) -> GammaPolicy:
    """Build the policy registered as ``name`` (an unknown name lists the known ones).

    Every built-in policy takes ``gamma`` (the fixed or starting γ) as its first option.
    """
    return POLICIES.get(name)(**options)


def as_policy(gamma: int | str | GammaPolicy) -> GammaPolicy:
    """A policy from an int (fixed γ), a registered name, or a policy object."""
    if isinstance(gamma, bool):
        raise ValueError(f"gamma must be an int >= 0, a policy name or a GammaPolicy, got {gamma!r}")
    if isinstance(gamma, int):
        return FixedGamma(gamma)
    if isinstance(gamma, str):
        return make_policy(gamma)
    if isinstance(gamma, GammaPolicy):
        _check_int("gamma policy's max_gamma", gamma.max_gamma, 0)
        return gamma
    raise ValueError(
        f"gamma must be an int >= 0, a policy name ({', '.join(POLICIES.names())}) or a GammaPolicy, "
        f"got {type(gamma).__name__}"
    )
