"""Experiments by name.

Built-in experiments are ``"module:attribute"`` strings imported only when asked for, so listing
names imports no experiment code. Third-party packages add experiments through the
``specdec.experiments`` entry-point group (``my-table = "my_pkg.tables:EXPERIMENT"``), or at run
time with :func:`register_experiment`.
"""

from __future__ import annotations

from experiments.experiment import Experiment
from specdec.registry import Registry

__all__ = ["EXPERIMENTS", "get_experiment", "register_experiment"]

EXPERIMENTS = Registry(
    "experiment",
    "specdec.experiments",
    builtins={
        "ep-scaling-model": "experiments.catalog.ep_scaling_model:EXPERIMENT",
        "gamma-sweep": "experiments.catalog.gamma_sweep:EXPERIMENT",
        "leviathan-table1": "experiments.catalog.leviathan_table1:EXPERIMENT",
        "leviathan-table3-analog": "experiments.catalog.leviathan_table3_analog:EXPERIMENT",
        "lossy-quality": "experiments.catalog.lossy_quality:EXPERIMENT",
        "moe-verify-cost": "experiments.catalog.moe_verify_cost:EXPERIMENT",
        "quality": "experiments.catalog.quality:EXPERIMENT",
        "serving-load": "experiments.catalog.serving_load:EXPERIMENT",
        "speedup-table": "experiments.catalog.speedup_table:EXPERIMENT",
        "switch-tables": "experiments.catalog.switch_tables:EXPERIMENT",
    },
)


def get_experiment(name: str) -> Experiment:
    """The experiment registered as ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    experiment = EXPERIMENTS.get(name)
    if not isinstance(experiment, Experiment):
        raise ValueError(f"{name!r} is registered as {type(experiment).__name__}, not an Experiment")
    return experiment


def register_experiment(experiment: Experiment) -> Experiment:
    """Register ``experiment`` under its name (replacing any earlier one); returns it."""
    if not isinstance(experiment, Experiment):
        raise ValueError(f"experiment must be an Experiment, got {type(experiment).__name__}")
    EXPERIMENTS.register(experiment.name, experiment)
    return experiment
