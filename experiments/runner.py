"""Run an experiment's sweep: skip finished runs, redo unfinished ones, shard, log, summarize.

Each run gets a clean ``<out>/<experiment>/<run_id>/`` (layout in :mod:`experiments.store`). A run is
finished only once its ``DONE`` marker is written, atomically and last, so stopping a sweep at any
moment loses no finished run, and the next invocation redoes the half-finished one from scratch.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from experiments.config import config_to_dict, has_field, run_id
from experiments.env import capture_env, describe_machine
from experiments.experiment import Experiment
from experiments.registry import get_experiment
from experiments.store import (
    METRICS_FILE,
    SUMMARY_FILE,
    MetricsWriter,
    RunRecord,
    experiment_dir,
    finish_run,
    is_finished,
    load_record,
    start_run,
    write_error,
)
from experiments.sweep import expand, shard
from experiments.wandb_log import NullRun, open_wandb_run
from specdec.summary import publish_summary, summary_document, write_json

__all__ = ["RunContext", "RunReport", "run_experiment", "summarize_experiment", "plan_configs"]


@dataclass
class RunContext:
    """What a run function gets besides its config: where to log and where its folder is."""

    experiment: str
    config: Any
    run_id: str
    run_dir: Path
    smoke: bool
    metrics: MetricsWriter
    wandb: NullRun = field(default_factory=NullRun)
    _next_step: int = 0

    def log(self, metrics: Mapping[str, Any], *, step: int | None = None) -> None:
        """Append one step's metrics to ``metrics.jsonl`` (and W&B); ``step`` defaults to a counter."""
        if step is None:
            step = self._next_step
        self._next_step = step + 1
        self.metrics.write({"step": step, "time": round(time.time(), 6), **metrics})
        self.wandb.log(metrics, step=step)


@dataclass
class RunReport:
    """What one invocation did."""

    experiment: str
    out_dir: Path
    planned: int
    in_shard: int
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    summary_path: Path | None = None
    published_path: Path | None = None


def plan_configs(
    experiment: Experiment,
    *,
    smoke: bool = False,
    base_overrides: Mapping[str, Any] | None = None,
    axis_overrides: Mapping[str, Any] | None = None,
) -> list[Any]:
    """The experiment's run configs, with YAML-style overrides applied to every sweep having the fields.

    A base override or an axis applies to each sweep whose config has the field(s); one that matches
    no sweep raises ``ValueError``.
    """
    sweeps = list(experiment.sweeps(smoke=smoke))
    for key, value in dict(base_overrides or {}).items():
        hits = [i for i, s in enumerate(sweeps) if has_field(s.base, key)]
        if not hits:
            raise ValueError(f"override {key!r} matches no config field of experiment {experiment.name!r}")
        for i in hits:
            sweeps[i] = sweeps[i].with_overrides(base={key: value})
    for key, values in dict(axis_overrides or {}).items():
        names = [k.strip() for k in key.split(",")]
        hits = [i for i, s in enumerate(sweeps) if all(has_field(s.base, n) for n in names)]
        if not hits:
            raise ValueError(f"axis {key!r} matches no config of experiment {experiment.name!r}")
        for i in hits:
            sweeps[i] = sweeps[i].with_overrides(axes={key: values})
    return expand(sweeps)


def _describe(config: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in config_to_dict(config).items() if not isinstance(v, (list, dict)))


def _run_one(
    experiment: Experiment, config: Any, run_dir: Path, env: dict, smoke: bool, use_wandb: bool, project: str
) -> float:
    start_run(run_dir, experiment.name, config, env)
    started = time.perf_counter()
    metrics = MetricsWriter(run_dir / METRICS_FILE)
    wandb_run: NullRun = NullRun()
    if use_wandb:
        wandb_run = open_wandb_run(
            directory=run_dir,
            project=project,
            name=f"{experiment.name}-{run_dir.name}",
            group=experiment.name,
            job_type="run",
            config={
                "experiment": experiment.name,
                "run_id": run_dir.name,
                "smoke": smoke,
                **config_to_dict(config),
            },
        )
    ctx = RunContext(
        experiment=experiment.name,
        config=config,
        run_id=run_dir.name,
        run_dir=run_dir,
        smoke=smoke,
        metrics=metrics,
        wandb=wandb_run,
    )
    try:
        result = experiment.runner_for(config)(config, ctx)
        if not isinstance(result, Mapping):
            raise ValueError(
                f"run function of {experiment.name!r} must return a mapping, got {type(result).__name__}"
            )
        wandb_run.set_summary({k: v for k, v in result.items() if isinstance(v, (int, float, str))})
    except BaseException:
        metrics.close()
        write_error(run_dir, traceback.format_exc())
        wandb_run.finish(exit_code=1)
        raise
    metrics.close()
    wandb_run.finish()
    wall = time.perf_counter() - started
    finish_run(run_dir, result, wall)
    return wall


def run_experiment(
    experiment: str | Experiment,
    *,
    out: Path | str = "results",
    smoke: bool = False,
    shard_spec: tuple[int, int] | None = None,
    use_wandb: bool = False,
    wandb_project: str = "specdec",
    base_overrides: Mapping[str, Any] | None = None,
    axis_overrides: Mapping[str, Any] | None = None,
    keep_going: bool = False,
    publish: bool = False,
    publish_dir: Path | None = None,
    console: Console | None = None,
) -> RunReport:
    """Run (the shard ``shard_spec = (i, n)`` of) an experiment's sweep under ``out``, then summarize it.

    Finished runs are skipped; an unfinished run folder is deleted and run again. With
    ``keep_going`` a failing run is reported and the sweep continues; otherwise the error propagates
    (finished runs stay finished). The summary covers every finished run of the plan in ``out``
    (from any shard) and says whether the plan is complete. ``publish`` copies a complete, non-smoke
    summary to ``paper/results/<experiment>.json``.
    """
    spec = get_experiment(experiment) if isinstance(experiment, str) else experiment
    console = console or Console(highlight=False, soft_wrap=True)
    configs = plan_configs(spec, smoke=smoke, base_overrides=base_overrides, axis_overrides=axis_overrides)
    for config in configs:
        spec.runner_for(config)  # fail before running anything if a config type has no run function
    mine = shard(configs, *shard_spec) if shard_spec else list(configs)
    exp_dir = experiment_dir(Path(out), spec.name)
    report = RunReport(experiment=spec.name, out_dir=exp_dir, planned=len(configs), in_shard=len(mine))
    todo = [c for c in mine if not is_finished(exp_dir / run_id(c))]
    shard_note = f" (shard {shard_spec[0]}/{shard_spec[1]}: {len(mine)})" if shard_spec else ""
    console.print(
        f"[bold]{spec.name}[/bold]: {len(configs)} runs{shard_note}, "
        f"{len(mine) - len(todo)} already finished, "
        f"{len(todo)} to run -> {exp_dir}"
    )
    report.skipped = [run_id(c) for c in mine if c not in todo]
    env = capture_env() if todo else {}
    for i, config in enumerate(todo, 1):
        rid = run_id(config)
        try:
            wall = _run_one(spec, config, exp_dir / rid, env, smoke, use_wandb, wandb_project)
        except Exception as e:
            report.failed.append(rid)
            console.print(
                f"  [{i}/{len(todo)}] {rid} [red]FAILED[/red]: {e!r} (traceback in {exp_dir / rid}/error.txt)"
            )
            if not keep_going:
                raise
            continue
        report.ran.append(rid)
        console.print(f"  [{i}/{len(todo)}] {rid} done in {wall:.2f} s  ({_describe(config)})")
    report.summary_path = summarize_experiment(
        spec, configs, exp_dir, smoke=smoke, use_wandb=use_wandb, wandb_project=wandb_project, console=console
    )
    if publish:
        if report.summary_path is None:
            raise ValueError(f"--publish: {spec.name} has no finished runs to publish")
        report.published_path = publish_summary(report.summary_path, publish_dir)
        console.print(f"published {report.published_path}")
    return report


def summarize_experiment(
    spec: Experiment,
    configs: Sequence[Any],
    exp_dir: Path,
    *,
    smoke: bool = False,
    use_wandb: bool = False,
    wandb_project: str = "specdec",
    console: Console | None = None,
) -> Path | None:
    """Summarize the finished runs of ``configs`` in ``exp_dir`` into ``summary.json`` (None if none)."""
    console = console or Console(highlight=False, soft_wrap=True)
    records: list[RunRecord] = []
    missing: list[str] = []
    for config in configs:
        rid = run_id(config)
        if is_finished(exp_dir / rid):
            records.append(load_record(exp_dir / rid, spec.name, config))
        else:
            missing.append(rid)
    if not records:
        console.print(f"{spec.name}: no finished runs to summarize")
        return None
    summary = spec.summarize(records)
    envs = [r.env() for r in records]
    machines = sorted({describe_machine(e) for e in envs})
    data = summary_document(
        experiment=spec.name,
        summary=summary,
        command=f"python -m experiments run {spec.name}" + (" --smoke" if smoke else ""),
        machine="; ".join(machines),
        env=envs[0],
        description=spec.description,
        smoke=smoke,
        num_runs=len(records),
        num_planned_runs=len(configs),
        missing_run_ids=missing,
    )
    path = exp_dir / SUMMARY_FILE
    write_json(path, data)
    status = (
        "complete" if not missing else f"partial: {len(missing)} of {len(configs)} runs not finished here"
    )
    console.print(f"summary ({status}) -> {path}")
    if use_wandb:
        _log_summary_to_wandb(data, exp_dir, wandb_project)
    return path


def _log_summary_to_wandb(data: dict, exp_dir: Path, project: str) -> None:
    """One W&B run per summary: its tables as W&B tables and its figures as rendered images."""
    run = open_wandb_run(
        directory=exp_dir,
        project=project,
        name=f"{data['experiment']}-summary",
        group=data["experiment"],
        job_type="summary",
        config={"experiment": data["experiment"], "smoke": data["smoke"]},
    )
    if not run.active:
        return
    for table in data["tables"]:
        keys = [c["key"] for c in table["columns"]]
        run.log_table(f"table/{table['name']}", keys, [[row.get(k) for k in keys] for row in table["rows"]])
    if data["figures"]:
        from paper.figures import render_figure  # matplotlib, imported only when plots are logged

        for figure in data["figures"]:
            stem = exp_dir / "figures" / figure["name"]
            paths = render_figure(figure, stem, formats=("png",))
            run.log_image(f"figure/{figure['name']}", paths[0], caption=figure["caption"])
    run.set_summary({"complete": data["complete"], "num_runs": data["num_runs"]})
    run.finish()
