"""Experiments: typed configs, sweeps, a resumable runner with W&B logging, and the paper's tables.

    python -m experiments list
    python -m experiments run leviathan-table1 --out results --wandb [--shard i/n] [--smoke] [--publish]

An experiment is a function returning a :class:`~experiments.sweep.Sweep` of frozen config
dataclasses, plus a run function per config type and a summary (see :mod:`experiments.experiment`),
registered by name in :data:`experiments.registry.EXPERIMENTS`. Run folders, the result-file format
and the summaries that ``paper/`` reads are described in docs/experiments.md.
"""
