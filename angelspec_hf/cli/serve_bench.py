"""`angelspec serve-bench`: the OpenAI-compatible server under load, each drafter against the server with none."""

from __future__ import annotations

import argparse
import json
import os

from ..arguments import (
    add_target_arguments,
    load_target_from_args,
    positive_float_list,
    positive_int,
    positive_int_list,
)
from .common import check_data_dir, check_drafter, check_prompt_sources, check_target_arguments, check_writable
from .serve import check_serving_installed


NAME = "serve-bench"
HELP = "the server under closed-loop streams and Poisson arrivals, each drafter against the server with none"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    parser.add_argument("--drafter", action="append", default=[], help="a drafter name or folder (repeatable)")
    parser.add_argument("--prompts", default="chat_code", help="prompt set name, mixture (a+b) or JSONL file")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--limit", type=positive_int, default=32, help="requests per load")
    parser.add_argument("--streams", type=positive_int_list, default="4,16", help="closed-loop concurrent streams")
    parser.add_argument("--rates", type=positive_float_list, default=None, help="Poisson arrivals, requests per s")
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--max-batch-size", type=positive_int, default=16)
    parser.add_argument("--output", default=None, help="JSON report (and a PNG plot beside it)")


def check(args: argparse.Namespace) -> None:
    check_serving_installed()
    check_target_arguments(args)
    for drafter in args.drafter:
        check_drafter(drafter)
    check_data_dir(args.data_dir)
    check_prompt_sources([args.prompts], args.data_dir, single_turn=True)
    check_writable("--output", args.output)


def run(args: argparse.Namespace) -> int:
    from ..benchmark.load_bench import format_load_table, run_load, write_load_plot
    from ..hub import load_drafter
    from ..prompts import load_prompts

    target = load_target_from_args(args)
    methods = [("no-drafter", None)] + [
        (os.path.basename(os.path.normpath(name)), load_drafter(name, target.model, target.tokenizer))
        for name in args.drafter
    ]
    prompts = load_prompts(args.prompts, data_dir=args.data_dir, limit=args.limit)["prompt"]
    loads = [("streams", int(n)) for n in args.streams.split(",")] if args.streams else []
    loads += [("rate", float(r)) for r in args.rates.split(",")] if args.rates else []
    report = run_load(target.model, target.tokenizer, methods, prompts, loads, args.max_tokens, args.max_batch_size)
    report["command"] = args.command_line
    print(format_load_table(report))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(report, handle, indent=1)
        write_load_plot(report, os.path.splitext(args.output)[0] + ".png")
        print(f"\nreport: {args.output}")
    return 0
