"""`angelspec` command line: `demo`, `regenerate` training responses, `estimate` a drafter's acceptance offline,
`bench` drafters against plain decoding (one sequence at a time, or batched with `--concurrency`), `batch` serves a
prompt set through the batched engine, `profile` this machine's linear-kernel plan and the verify cost D-cut plans
with."""

# One module per command, each with `NAME`, `HELP`, `add_arguments(parser)`, `check(args)` (what the command line
# names on disk, before any model loads: raises `UsageError`) and `run(args)` (the exit status). Heavy imports (torch,
# transformers) stay inside `check` and `run`: `angelspec --help` answers without them.

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from . import (
    batch,
    bench,
    curve,
    demo,
    estimate,
    export,
    index_outputs,
    profile,
    regenerate,
    serve,
    serve_bench,
    snapshot,
    suite,
    teacher_forced,
)
from .common import UsageError


COMMANDS = {
    command.NAME: command
    for command in (
        regenerate,
        teacher_forced,
        demo,
        profile,
        batch,
        estimate,
        export,
        curve,
        snapshot,
        index_outputs,
        suite,
        bench,
        serve,
        serve_bench,
    )
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="angelspec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():  # each command's --help shows its defaults
        command.add_arguments(
            subparsers.add_parser(
                command.NAME, help=command.HELP, formatter_class=argparse.ArgumentDefaultsHelpFormatter
            )
        )
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    command = COMMANDS[args.command]
    threads = (
        [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] if "OMP_NUM_THREADS" in os.environ else []
    )  # timings depend on it
    args.command_line = " ".join([*threads, "angelspec", *argv])
    try:
        command.check(args)
        status = command.run(args)
    except UsageError as error:  # from `check`, or found only once loaded (e.g. a drafter that has no such layout)
        print(f"angelspec {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)
    if status:
        sys.exit(status)
