"""`angelspec bench`: drafters against plain decoding on a prompt set, one sequence at a time or batched
(`--concurrency`)."""

from __future__ import annotations

import argparse

from ..arguments import add_bench_arguments
from .common import (
    UsageError,
    check_context,
    check_data_dir,
    check_model,
    check_prompt_sources,
    check_target_arguments,
    check_writable,
)


NAME = "bench"
HELP = "speculative vs plain decoding on a prompt set"
add_arguments = add_bench_arguments


def check(args: argparse.Namespace) -> None:
    check_target_arguments(args)
    for spec in args.drafter:  # DIR or DIR@SCHEDULES
        check_model("--drafter", spec.partition("@")[0], "drafter", hub=False)
    check_context(args)
    check_data_dir(args.data_dir)
    check_prompt_sources([args.prompts], args.data_dir, single_turn=True)
    check_writable("--output", args.output)
    if args.concurrency and args.limit is not None:
        needed = max(max(int(c) for c in args.concurrency.split(",")), args.min_requests)
        if args.limit < needed:
            raise UsageError(
                f"--limit {args.limit} leaves too few prompts: --concurrency {args.concurrency} with --min-requests "
                f"{args.min_requests} needs {needed}"
            )


def run(args: argparse.Namespace) -> int:
    from ..benchmark.bench import main

    main(args)
    return 0
