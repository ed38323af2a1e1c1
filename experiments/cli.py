"""``python -m experiments COMMAND ...``: a thin layer over :mod:`experiments.runner`.

Commands live in :data:`COMMANDS` (name -> ``main(argv) -> int``), imported only when called, so a
command whose module is missing (written by another engineer, or an optional extra) fails alone
with a clear message. Third-party commands register through the ``specdec.experiment_commands``
entry-point group.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.cli_args import ArgumentParser, stderr_line
from specdec.registry import Registry

__all__ = ["COMMANDS", "main"]

_BUILTIN_COMMANDS = {
    "list": "experiments.cli:cmd_list",
    "run": "experiments.cli:cmd_run",
    "summarize": "experiments.cli:cmd_summarize",
    "train-drafter": "specdec.drafters.eagle.train.command:main",  # an alias of `specdec train-head`
    "bench-moe": "experiments.bench_moe:main",
    "copy-agreement": "experiments.copy_agreement:main",
}
COMMANDS = Registry("command", "specdec.experiment_commands", builtins=_BUILTIN_COMMANDS)
HELP = {
    "list": "list the registered experiments and their number of runs",
    "run": "run an experiment's sweep (skips finished runs) and write its summary",
    "summarize": "rebuild an experiment's summary.json from the finished runs in --out (e.g. after shards)",
    "train-drafter": "an alias of `specdec train-head`: train the EAGLE draft head",
    "bench-moe": "benchmark the MoE layer against transformers (experiments.bench_moe)",
    "copy-agreement": "does the draft head copy from the context? (experiments.copy_agreement)",
}


def _usage() -> str:
    lines = ["usage: python -m experiments COMMAND [ARGS...]", "", "commands:"]
    for name in COMMANDS.names():
        lines.append(f"  {name:<15} {HELP.get(name, '')}")
    lines.append("")
    lines.append("Run `python -m experiments COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv[0]`` to its command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    prog = f"python -m experiments {name}"
    try:
        command = COMMANDS.get(name)  # an unknown name lists the known ones
        return int(command(rest) or 0)
    except ValueError as e:  # a bad argument, config file, --set value or field: one line
        stderr_line(prog, e)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished runs are kept (run it again to resume)", file=sys.stderr)
        return 130


# --------------------------------------------------------------------------------------------- list


def cmd_list(argv: Sequence[str]) -> int:
    """``list``: names, number of runs (full and --smoke) and descriptions."""
    parser = ArgumentParser(prog="python -m experiments list", description=HELP["list"])
    parser.parse_args(argv)
    from experiments.registry import EXPERIMENTS, get_experiment

    for name in EXPERIMENTS.names():
        try:
            experiment = get_experiment(name)
            runs = f"{len(experiment.configs())} runs ({len(experiment.configs(smoke=True))} with --smoke)"
            description = experiment.description
        except Exception as e:  # noqa: BLE001 - one broken experiment must not hide the others
            runs, description = "unavailable", f"cannot load: {e!r}"
        print(f"{name:<22} {runs:<28} {description}")
    return 0


# ---------------------------------------------------------------------------------------- run/summarize


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE (VALUE read as YAML), got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ValueError(
                f"--set {key.strip()}: the value {value!r} is not valid YAML ({err.problem})"
            ) from None
    return out


def _overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Base and axis overrides from ``--config FILE.yaml`` (keys ``base`` and ``axes``) and ``--set``."""
    from experiments.config import load_yaml_mapping

    base: dict[str, Any] = {}
    axes: dict[str, Any] = {}
    if args.config:
        data = load_yaml_mapping(args.config)
        unknown = set(data) - {"experiment", "base", "axes"}
        if unknown:
            raise ValueError(
                f"--config {args.config}: unknown keys {sorted(unknown)}; expected base, axes, experiment"
            )
        if data.get("experiment", args.name) != args.name:
            raise ValueError(
                f"--config {args.config} is for experiment {data['experiment']!r}, not {args.name!r}"
            )
        base.update(data.get("base") or {})
        axes.update(data.get("axes") or {})
    base.update(_parse_set(args.set))
    for flag in ("device", "dtype"):  # --device / --dtype: a base override of every config with the field
        value = getattr(args, flag, None)
        if value is not None:
            base[flag] = value
    return base, axes


def _check_placement_flags(experiment: Any, args: argparse.Namespace, smoke: bool) -> None:
    """``ValueError`` naming the experiment when ``--device`` / ``--dtype`` is given and none of its
    configs builds a model (none has the field)."""
    from experiments.config import has_field

    for flag in ("device", "dtype"):
        if getattr(args, flag, None) is not None and not any(
            has_field(s.base, flag) for s in experiment.sweeps(smoke=smoke)
        ):
            raise ValueError(
                f"--{flag}: experiment {experiment.name!r} builds no model "
                f"(its configs have no {flag!r} field)"
            )


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="experiment name (see `python -m experiments list`)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="output folder (default: results/)")
    parser.add_argument("--smoke", action="store_true", help="the tiny CI version of the experiment")
    parser.add_argument("--config", type=Path, help="YAML with `base:` field overrides and `axes:` to sweep")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    parser.add_argument(
        "--device",
        help="torch device for every config that builds a model: cpu (their default), cuda, cuda:1, ...",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="compute dtype for every config that builds a model (default: the weights format's own)",
    )
    parser.add_argument(
        "--wandb", action="store_true", help="log to W&B (offline unless WANDB_API_KEY is set)"
    )
    parser.add_argument("--wandb-project", default="specdec", help="W&B project (default: specdec)")
    parser.add_argument("--publish", action="store_true", help="copy the summary to paper/results/NAME.json")
    parser.add_argument("--publish-dir", type=Path, help="where --publish copies to (default: paper/results)")
    parser.add_argument(
        "--allow-large", action="store_true", help="accept a plan of over 10,000 runs (refused otherwise)"
    )


def _announce_wandb(out: Path) -> None:
    from experiments.wandb_log import wandb_mode

    if wandb_mode() == "offline":
        print(
            f"W&B: offline mode (no WANDB_API_KEY); runs are written under {out}/<experiment>/*/wandb; "
            "upload later with `wandb sync <that folder>/offline-run-*`."
        )


def cmd_run(argv: Sequence[str]) -> int:
    """``run NAME [--out DIR] [--wandb] [--shard i/n] [--smoke] [--publish] ...``."""
    parser = ArgumentParser(prog="python -m experiments run", description=HELP["run"])
    _common(parser)
    parser.add_argument("--shard", help="run only shard i of n (0 <= i < n), e.g. --shard 0/4")
    parser.add_argument("--keep-going", action="store_true", help="report a failing run and continue")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan's size (stderr), then its runs as they are built (this shard's, with --shard)",
    )
    args = parser.parse_args(argv)
    from experiments.registry import get_experiment
    from experiments.runner import run_experiment
    from experiments.sweep import parse_shard

    shard_spec = parse_shard(args.shard) if args.shard else None
    base, axes = _overrides(args)  # a ValueError here is a user error: main() prints it on one line
    experiment = get_experiment(args.name)
    _check_placement_flags(experiment, args, args.smoke)
    if args.device is not None and not args.dry_run:  # cuda on a machine without one: now, not per run
        from specdec.targets import check_device

        check_device(args.device)
    if args.publish and args.smoke:
        raise ValueError("--publish with --smoke would overwrite the paper's results with a smoke run")
    if args.dry_run:
        return _dry_run(experiment, args.smoke, base, axes, shard_spec)
    if args.wandb:
        _announce_wandb(args.out)
    report = run_experiment(
        experiment,
        out=args.out,
        smoke=args.smoke,
        shard_spec=shard_spec,
        use_wandb=args.wandb,
        wandb_project=args.wandb_project,
        base_overrides=base,
        axis_overrides=axes,
        keep_going=args.keep_going,
        allow_large=args.allow_large,
        publish=args.publish,
        publish_dir=args.publish_dir,
    )
    print(
        f"{report.experiment}: ran {len(report.ran)}, skipped {len(report.skipped)} finished, "
        f"failed {len(report.failed)}"
    )
    return 1 if report.failed else 0


def _dry_run(
    experiment: Any,
    smoke: bool,
    base: dict[str, Any],
    axes: dict[str, Any],
    shard_spec: tuple[int, int] | None,
) -> int:
    """``run --dry-run``: the plan's size on stderr (from the axis lengths, before anything is built),
    then ``run_id ConfigType {config JSON}`` per run on stdout as each is built (a shard needs every
    run id first). Any size is printed, as a dry run runs nothing."""
    from experiments.config import config_to_dict, run_id
    from experiments.runner import LARGE_PLAN_RUNS, plan_sweeps
    from experiments.sweep import iter_expand, plan_size, shard

    sweeps = plan_sweeps(experiment, smoke=smoke, base_overrides=base, axis_overrides=axes)
    size = plan_size(sweeps)
    note = f" (over {LARGE_PLAN_RUNS:,}: `run` needs --allow-large)" if size > LARGE_PLAN_RUNS else ""
    print(f"{experiment.name}: {size:,} runs in the plan{note}", file=sys.stderr, flush=True)
    configs = iter_expand(sweeps)
    if shard_spec:
        configs = iter(shard(list(configs), *shard_spec))
    try:
        for config in configs:
            print(run_id(config), type(config).__name__, json.dumps(config_to_dict(config)))
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has gone; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def cmd_summarize(argv: Sequence[str]) -> int:
    """``summarize NAME --out DIR [--publish]``: rebuild summary.json from the finished runs."""
    parser = ArgumentParser(prog="python -m experiments summarize", description=HELP["summarize"])
    _common(parser)
    args = parser.parse_args(argv)
    from experiments.registry import get_experiment
    from experiments.runner import plan_configs, summarize_experiment
    from experiments.store import experiment_dir
    from specdec.summary import publish_summary

    base, axes = _overrides(args)
    experiment = get_experiment(args.name)
    _check_placement_flags(experiment, args, args.smoke)
    configs = plan_configs(
        experiment, smoke=args.smoke, base_overrides=base, axis_overrides=axes, allow_large=args.allow_large
    )
    if args.wandb:
        _announce_wandb(args.out)
    path = summarize_experiment(
        experiment,
        configs,
        experiment_dir(args.out, experiment.name),
        smoke=args.smoke,
        use_wandb=args.wandb,
        wandb_project=args.wandb_project,
    )
    if path is None:
        return 1
    if args.publish:
        print(f"published {publish_summary(path, args.publish_dir)}")
    return 0
