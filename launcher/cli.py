"""The `vescale` command line tool."""
from __future__ import annotations

import argparse
import sys

from launcher.arg_types import positive_int, seconds
from vescale_engine import __version__
from vescale_engine.logs import install as install_logging


def _add_validate_parser(sub):
    p = sub.add_parser("validate", help="check a config against the JSON Schema",
                       description="Validate a veScale/DeepSpeed JSON config: every problem "
                                   "with its JSON path; DeepSpeed's aliases read as their "
                                   "canonical names; each \"auto\" and who fills it in "
                                   "(Hugging Face Trainer/Accelerate) or what DeepSpeed reads "
                                   "it as; the keys accepted but not acted on; and, as "
                                   "warnings, the top-level keys ignored as DeepSpeed "
                                   "ignores them.")
    p.add_argument("config", metavar="CONFIG.json")
    p.set_defaults(run=_run_validate)


def _run_validate(args) -> int:
    from config_schemas.validate import ConfigError, check_config, read_config

    try:
        config = read_config(args.config)
    except ConfigError as err:
        print(f"vescale validate: error: {err}", file=sys.stderr)
        return 2
    report = check_config(config)
    for message in report.errors:
        print(f"{args.config}: {message}", file=sys.stderr)
    if report.errors:
        print(f"{args.config}: {len(report.errors)} problem(s)", file=sys.stderr)
        return 2
    for entry in report.ignored:
        print(f"{args.config}: warning: ignored: {entry}", file=sys.stderr)
    for alias in report.aliases:
        print(f"{args.config}: alias: {alias}")
    for auto in report.auto:
        print(f'{args.config}: "auto": {auto}')
    if report.not_acted_on:
        print(f"{args.config}: accepted but not acted on: " + "; ".join(report.not_acted_on))
    if report.auto:
        print(f'{args.config}: valid, with {len(report.auto)} "auto" value(s) as listed')
    else:
        print(f"{args.config}: valid")
    return 0


def _add_run_parser(sub):
    p = sub.add_parser("run", help="start the ranks of a training script",
                       description="Start a training script's ranks: locally (torchrun's "
                                   "environment, rank-prefixed output, all stopped when one "
                                   "fails, each rank bound to its own cores on CPU), or "
                                   "through mpirun or the deepspeed launcher over a hostfile.")
    p.add_argument("--nproc", type=positive_int, default=None, metavar="N",
                   help="ranks per machine (default 1, or each host's slots in the hostfile)")
    p.add_argument("--hostfile", metavar="F",
                   help="machines for --launcher mpi/deepspeed: lines 'HOST slots=N', "
                        "'HOST:N' or 'HOST'")
    p.add_argument("--launcher", choices=["local", "mpi", "deepspeed"], default="local",
                   help="local (default): ranks on this machine; mpi: mpirun (Open MPI); "
                        "deepspeed: the deepspeed launcher")
    p.add_argument("--threads-per-rank", type=positive_int, default=None, metavar="T",
                   help="OMP_NUM_THREADS per rank (default: the rank's share of the cores)")
    p.add_argument("--no-bind-cores", dest="bind_cores", action="store_false",
                   help="local launcher: do not bind each rank to its own cores (CPU ranks) or to "
                        "its GPU's NUMA node (CUDA ranks)")
    p.add_argument("--stop-grace-s", type=seconds, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT/SIGHUP: seconds the ranks get to exit after the signal "
                        "is passed on to them (or to mpirun's ranks / deepspeed's launcher) "
                        "before what is left is killed (default 30; an opt-in preemption save "
                        "needs this time)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(run=_run_run)


def _run_run(args) -> int:
    from launcher.run import launch
    return launch(args.launcher, args.nproc, args.hostfile, [args.script, *args.script_args],
                  args.threads_per_rank, args.bind_cores, stop_grace_s=args.stop_grace_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vescale", description="veScale Engine tools")
    parser.add_argument("--version", action="version", version=f"vescale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from launcher.plan_cli import add_parser as _add_plan_parser
    _add_plan_parser(sub)
    _add_validate_parser(sub)
    _add_run_parser(sub)
    from launcher.checkpoint_cli import add_parsers as _add_checkpoint_parsers
    _add_checkpoint_parsers(sub)
    return parser


def main(argv=None) -> int:
    install_logging()  # the library's lines print without logging setup (logs.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as err:  # ShapesError and PlanError are ValueErrors
        print(f"vescale {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `vescale plan ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
