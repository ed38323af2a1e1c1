"""Run an experiment's sweep: skip finished runs, redo unfinished ones, shard, log, summarize.

Each run gets a clean ``<out>/<experiment>/<run_id>/`` (layout in :mod:`experiments.store`). A run is
finished only once its ``DONE`` marker is written, atomically and last, beside every other file of
the run, so stopping a sweep at any moment loses no finished run, and the next invocation redoes the
half-finished one from scratch (and a ``DONE`` folder that lost a file, saying why).

Several processes may run one experiment into one ``--out`` at once: each run is done under its
lock, in a working folder renamed into place when it ends, so each run is done once and nothing is
lost. A process first does the runs no other process holds, then waits for each of the others in
turn and does those the other process did not finish.

A plan is sized before it is built (the product of its axis lengths): one of more than
:data:`LARGE_PLAN_RUNS` runs needs ``allow_large=True`` (``--allow-large``).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import Timeout
from rich.console import Console

from experiments.config import config_to_dict, config_type_name, has_field, run_id
from experiments.env import capture_env, describe_machine
from experiments.experiment import Experiment
from experiments.registry import get_experiment
from experiments.run_result import ResultFieldError, odd_fields
from experiments.store import (
    ENV_FILE,
    METRICS_FILE,
    RESULT_FILE,
    SUMMARY_FILE,
    MetricsWriter,
    RunRecord,
    check_not_a_link,
    damage,
    drop_lock_if_finished,
    experiment_dir,
    fail_run,
    finish_run,
    is_finished,
    is_marked_done,
    load_record,
    missing_files,
    run_lock,
    start_run,
)
from experiments.sweep import Sweep, iter_expand, plan_size, shard
from experiments.wandb_log import NullRun, open_wandb_run
from specdec.summary import Summary, publish_summary, summary_document, write_json, write_results

__all__ = [
    "LARGE_PLAN_RUNS",
    "RunContext",
    "RunReport",
    "run_experiment",
    "summarize_experiment",
    "plan_sweeps",
    "check_plan_size",
    "plan_configs",
]

LARGE_PLAN_RUNS = 10_000
"""A plan of more runs than this needs ``allow_large=True`` (``--allow-large``)."""


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
    env: dict[str, Any] = field(default_factory=dict)
    _next_step: int = 0

    def record_target(self, target: Any) -> None:
        """Record in the run's ``env.json`` where the target it opened runs (its device, the device's
        name, its dtype and weight format: :func:`experiments.env.target_placement`)."""
        from experiments.env import target_placement

        self.record_env(target_placement(target))

    def record_env(self, fields: Mapping[str, Any]) -> None:
        """Add ``fields`` to the run's ``env.json`` (what only the run knows, such as the device a
        server it started was asked to run on)."""
        self.env.update(fields)
        write_json(self.run_dir / ENV_FILE, self.env)

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


def plan_sweeps(
    experiment: Experiment,
    *,
    smoke: bool = False,
    base_overrides: Mapping[str, Any] | None = None,
    axis_overrides: Mapping[str, Any] | None = None,
) -> tuple[Sweep, ...]:
    """The experiment's sweeps, with YAML-style overrides applied to every sweep having the fields.

    A base override or an axis applies to each sweep whose config has the field(s); one that matches
    no sweep raises ``ValueError``. Nothing is expanded (:func:`~experiments.sweep.plan_size` counts).
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
    return tuple(sweeps)


def check_plan_size(name: str, size: int, *, allow_large: bool) -> None:
    """``ValueError`` naming ``--allow-large`` for a plan of more than :data:`LARGE_PLAN_RUNS` runs."""
    if size > LARGE_PLAN_RUNS and not allow_large:
        raise ValueError(
            f"{name}: the plan has {size:,} runs, over the limit of {LARGE_PLAN_RUNS:,}; check the axes "
            "(--dry-run streams the runs) and pass --allow-large (allow_large=True) to go ahead"
        )


def plan_configs(
    experiment: Experiment,
    *,
    smoke: bool = False,
    base_overrides: Mapping[str, Any] | None = None,
    axis_overrides: Mapping[str, Any] | None = None,
    allow_large: bool = False,
    console: Console | None = None,
) -> list[Any]:
    """The experiment's run configs (:func:`plan_sweeps`, expanded), each run id once.

    The plan is sized first; one of more than :data:`LARGE_PLAN_RUNS` runs raises ``ValueError``
    unless ``allow_large``. With a ``console``, the size is printed before the plan is built, and
    so is the progress of building a large one.
    """
    sweeps = plan_sweeps(
        experiment, smoke=smoke, base_overrides=base_overrides, axis_overrides=axis_overrides
    )
    size = plan_size(sweeps)
    check_plan_size(experiment.name, size, allow_large=allow_large)
    if console is not None:
        console.print(f"[bold]{experiment.name}[/bold]: {size:,} runs in the plan")
    every = max(LARGE_PLAN_RUNS, size // 10)
    configs = []
    for config in iter_expand(sweeps):
        configs.append(config)
        if console is not None and size > LARGE_PLAN_RUNS and len(configs) % every == 0:
            console.print(f"  built {len(configs):,} of {size:,} run configs")
    return configs


def _describe(config: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in config_to_dict(config).items() if not isinstance(v, (list, dict)))


def _run_one(
    experiment: Experiment, config: Any, exp_dir: Path, env: dict, smoke: bool, use_wandb: bool, project: str
) -> float:
    """Run ``config`` in a working folder moved to ``<exp_dir>/<run_id>`` at the end (hold its lock)."""
    rid = run_id(config)
    run_dir = start_run(exp_dir, rid, experiment.name, config, env)
    started = time.perf_counter()
    metrics = MetricsWriter(run_dir / METRICS_FILE)
    wandb_run: NullRun = NullRun()
    if use_wandb:
        wandb_run = open_wandb_run(
            directory=run_dir,
            project=project,
            name=f"{experiment.name}-{rid}",
            group=experiment.name,
            job_type="run",
            config={
                "experiment": experiment.name,
                "run_id": rid,
                "smoke": smoke,
                **config_to_dict(config),
            },
        )
    ctx = RunContext(
        experiment=experiment.name,
        config=config,
        run_id=rid,
        run_dir=run_dir,
        smoke=smoke,
        metrics=metrics,
        wandb=wandb_run,
        env=dict(env),
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
        wandb_run.finish(exit_code=1)
        fail_run(run_dir, exp_dir / rid, traceback.format_exc())
        raise
    metrics.close()
    wandb_run.finish()
    wall = time.perf_counter() - started
    finish_run(run_dir, exp_dir / rid, result, wall)
    return wall


def _todo(configs: Sequence[Any], exp_dir: Path, console: Console) -> list[Any]:
    """The configs whose run is not finished in ``exp_dir``. A ``DONE`` run that is damaged is redone
    (saying why); an unfinished run behind a symbolic link is refused before anything runs."""
    todo = []
    for config in configs:
        run_dir = exp_dir / run_id(config)
        if is_marked_done(run_dir):
            why = damage(run_dir)
            if why is None:
                continue
            console.print(f"  {run_dir.name}: marked DONE but {why}; running it again")
        check_not_a_link(run_dir)
        todo.append(config)
    return todo


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
    allow_large: bool = False,
    publish: bool = False,
    publish_dir: Path | None = None,
    console: Console | None = None,
) -> RunReport:
    """Run (the shard ``shard_spec = (i, n)`` of) an experiment's sweep under ``out``, then summarize it.

    The plan's size is printed first; one of more than :data:`LARGE_PLAN_RUNS` runs needs
    ``allow_large``. Finished runs are skipped; an unfinished run folder (or a ``DONE`` one that lost
    a file) is deleted and run again; one behind a symbolic link is refused (``ValueError``). Other
    processes may run the same plan into ``out`` at once (module docstring). With ``keep_going`` a
    failing run is reported and the sweep continues; otherwise the error propagates (finished runs
    stay finished). The summary covers every finished run of the plan in ``out``
    (from any shard) and says whether the plan is complete. ``publish`` copies a complete, non-smoke
    summary to ``paper/results/<experiment>.json``.
    """
    spec = get_experiment(experiment) if isinstance(experiment, str) else experiment
    console = console or Console(highlight=False, soft_wrap=True)
    configs = plan_configs(
        spec,
        smoke=smoke,
        base_overrides=base_overrides,
        axis_overrides=axis_overrides,
        allow_large=allow_large,
        console=console,
    )
    for config in configs:
        spec.runner_for(config)  # fail before running anything if a config type has no run function
    mine = shard(configs, *shard_spec) if shard_spec else list(configs)
    exp_dir = experiment_dir(Path(out), spec.name)
    report = RunReport(experiment=spec.name, out_dir=exp_dir, planned=len(configs), in_shard=len(mine))
    todo = _todo(mine, exp_dir, console)
    shard_note = f" (shard {shard_spec[0]}/{shard_spec[1]}: {len(mine)})" if shard_spec else ""
    console.print(
        f"  {len(configs)} distinct runs{shard_note}, {len(mine) - len(todo)} already finished, "
        f"{len(todo)} to run -> {exp_dir}"
    )
    todo_ids = {run_id(c) for c in todo}
    report.skipped = [run_id(c) for c in mine if run_id(c) not in todo_ids]
    env = capture_env() if todo else {}

    def finished_elsewhere(rid: str, where: str) -> bool:
        if not is_finished(exp_dir / rid):
            return False
        report.skipped.append(rid)  # another process finished it since the plan was read
        console.print(f"{where} finished by another process")
        return True

    def attempt(i: int, config: Any, *, wait: bool) -> bool:
        """Run ``config`` under its lock (False if another process holds it and ``wait`` is off)."""
        rid = run_id(config)
        where = f"  [{i}/{len(todo)}] {rid}"
        if finished_elsewhere(rid, where):
            return True
        lock = run_lock(exp_dir, rid)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if not wait:
                return False
            console.print(f"{where}: another process is running it; waiting for it")
            lock.acquire()
        try:
            if finished_elsewhere(rid, where):
                return True
            try:
                wall = _run_one(spec, config, exp_dir, env, smoke, use_wandb, wandb_project)
            except Exception as e:
                report.failed.append(rid)
                console.print(f"{where} [red]FAILED[/red]: {e!r} (traceback in {exp_dir / rid}/error.txt)")
                if not keep_going:
                    raise
                return True
            report.ran.append(rid)
            console.print(f"{where} done in {wall:.2f} s  ({_describe(config)})")
            return True
        finally:
            lock.release()

    try:
        held = []
        for i, config in enumerate(todo, 1):
            if not attempt(i, config, wait=False):
                held.append((i, config))
        for i, config in held:  # the runs another process held: wait for each, do it if still unfinished
            attempt(i, config, wait=True)
    finally:
        for config in todo:
            drop_lock_if_finished(exp_dir, run_id(config))
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
    """Summarize the finished runs of ``configs`` in ``exp_dir`` into ``summary.json`` (None if none).

    A run marked ``DONE`` that lacks a file counts as not finished (with a line saying so). A
    ``result.json`` that cannot be read, or that lacks a field the summary needs, raises
    ``ValueError`` naming the file and the field; so does one whose structure differs from the
    other runs' when the experiment's ``summarize`` fails on it.
    """
    console = console or Console(highlight=False, soft_wrap=True)
    records: list[RunRecord] = []
    missing: list[str] = []
    for config in configs:
        rid = run_id(config)
        run_dir = exp_dir / rid
        if not is_marked_done(run_dir):
            missing.append(rid)
            continue
        lacking = missing_files(run_dir)
        if lacking:
            console.print(
                f"  {rid}: marked DONE but {', '.join(lacking)} missing; counted as not finished "
                "(`run` runs it again)"
            )
            missing.append(rid)
            continue
        records.append(load_record(run_dir, spec.name, config))
    if not records:
        console.print(f"{spec.name}: no finished runs to summarize")
        return None
    summary = _summarize(spec, records)
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
    write_results(path, data)
    status = (
        "complete" if not missing else f"partial: {len(missing)} of {len(configs)} runs not finished here"
    )
    console.print(f"summary ({status}) -> {path}")
    if use_wandb:
        _log_summary_to_wandb(data, exp_dir, wandb_project)
    return path


def _summarize(spec: Experiment, records: Sequence[RunRecord]) -> Summary:
    """``spec.summarize(records)``; a ``KeyError`` or ``TypeError`` on the results becomes a
    ``ValueError`` naming the result files whose structure differs from their peers'."""
    try:
        return spec.summarize(records)
    except ResultFieldError:
        raise  # already names the file and the field
    except (KeyError, TypeError, IndexError, AttributeError) as err:
        odd = odd_fields([(r.run_dir / RESULT_FILE, config_type_name(r.config), r.result) for r in records])
        if odd:
            where = "; ".join(odd[:3]) + (f"; and {len(odd) - 3} more" if len(odd) > 3 else "")
        else:
            where = "no result.json differs in structure from the other runs of its config type"
        raise ValueError(
            f"{spec.name}: summarize failed on the runs' results ({type(err).__name__}: {err}): {where}"
        ) from err


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
