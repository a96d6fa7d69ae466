"""`angelspec suite`: every method on every domain, plus the batched engine: JSON, Markdown, plots."""

from __future__ import annotations

import argparse
import os

from ..arguments import add_suite_arguments
from .common import UsageError, check_data_dir, check_target_arguments, check_writable


NAME = "suite"
HELP = "every method on every domain, plus the batched engine: JSON, Markdown, plots"
add_arguments = add_suite_arguments


def check(args: argparse.Namespace) -> None:
    check_target_arguments(args)
    check_data_dir(args.data_dir)
    if not os.path.isdir(args.drafters_dir):
        raise UsageError(f"--drafters-dir {args.drafters_dir}: no such folder")
    check_writable("--benchmarks-md", args.benchmarks_md)
    check_writable("--output-dir", args.output_dir, folder=True)


def run(args: argparse.Namespace) -> int:
    from ..benchmark.suite import main

    main(args)
    return 0
