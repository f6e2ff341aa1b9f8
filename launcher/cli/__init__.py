"""`accum-sched` subcommands. Each lives in its own module with `add_parser(subparsers)` and `main(args) -> int`,
imported only when chosen, so `check` and `slurm` never pay for (or need) torch."""
from __future__ import annotations

import argparse
import importlib
import sys

from launcher.checkpoint.pickle_scan import UnsafePickle
from launcher.errors import ConfigError
from launcher.launch import rundir

# subcommand -> module implementing it; keep the modules' top-level imports free of torch.
COMMANDS = {
    "run": "launcher.cli.run",
    "check": "launcher.cli.check",
    "slurm": "launcher.cli.slurm",
    "report": "launcher.cli.report",
    "plan": "launcher.cli.plan",
    "cbs": "launcher.cli.cbs",
    "schema": "launcher.cli.schema",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accum-sched",
        description="Distributed PyTorch training with a scheduled gradient-accumulation factor.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue  # a subcommand not built yet
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"error: {err.line()}", file=sys.stderr)
        return 2
    except UnsafePickle as err:  # a planted or foreign pickle in a checkpoint: the workers' own line (bad input)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        rundir.release_all()  # the output_dir lock of `run` ends with the command (also when called in-process)


if __name__ == "__main__":
    raise SystemExit(main())
