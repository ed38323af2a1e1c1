"""An experiment: a plan (a function returning sweeps of configs), run functions per config type, a summary.

Writing one takes three small functions::

    def plan(*, smoke: bool = False) -> Sweep:             # what to run
        return Sweep(RowConfig(alpha=0.6, gamma=2), {"alpha,gamma": [(0.6, 2), (0.8, 5)]})

    def run_row(config: RowConfig, ctx: RunContext) -> dict:   # one run; ctx.log(...) per step
        ...
        return {"speedup": s}                                  # -> result.json

    def summarize(records: Sequence[RunRecord]) -> Summary:    # finished runs -> tables/figures
        ...

    EXPERIMENT = Experiment(name="my-table", description="...", plan=plan,
                            runners={RowConfig: run_row}, summarize=summarize)

and one line in ``experiments.registry`` (or an entry point in the ``specdec.experiments`` group).
Several experiments can share a config type and its run function; they then differ in plan and
summary. The decode-run experiments share a config base and run helpers instead
(:mod:`experiments.catalog.specdec_runs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from experiments.sweep import Sweep, expand

if TYPE_CHECKING:
    from experiments.runner import RunContext
    from experiments.store import RunRecord
    from specdec.summary import Summary

__all__ = ["Experiment", "RunFn", "SummarizeFn", "PlanFn"]

RunFn = Callable[[Any, "RunContext"], Mapping[str, Any]]
SummarizeFn = Callable[[Sequence["RunRecord"]], "Summary"]
PlanFn = Callable[..., "Sweep | Sequence[Sweep]"]


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """A named experiment: ``plan(smoke=...)`` gives its sweeps, ``runners`` run each config type."""

    name: str
    description: str
    plan: PlanFn
    runners: Mapping[type, RunFn]
    summarize: SummarizeFn

    def __post_init__(self) -> None:
        if not self.name or not all(ch.isalnum() or ch in "-_" for ch in self.name):
            raise ValueError(
                f"Experiment.name must be a [A-Za-z0-9_-] string (a folder name), got {self.name!r}"
            )
        if not self.runners:
            raise ValueError(
                f"Experiment {self.name!r}: runners must map at least one config type to a function"
            )

    def sweeps(self, *, smoke: bool = False) -> tuple[Sweep, ...]:
        """The experiment's sweeps (the tiny CI version with ``smoke=True``)."""
        plan = self.plan(smoke=smoke)
        return (plan,) if isinstance(plan, Sweep) else tuple(plan)

    def configs(self, *, smoke: bool = False) -> list[Any]:
        """Every run config of the plan, each run id once."""
        return expand(self.sweeps(smoke=smoke))

    def runner_for(self, config: Any) -> RunFn:
        """The run function for ``config``'s type; an unknown type lists the known ones."""
        try:
            return self.runners[type(config)]
        except KeyError:
            known = ", ".join(t.__name__ for t in self.runners)
            raise ValueError(
                f"experiment {self.name!r} has no run function for {type(config).__name__}; known: {known}"
            ) from None
