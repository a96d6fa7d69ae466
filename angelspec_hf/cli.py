"""`angelspec` command line: `regenerate` training responses, `bench` drafters against plain decoding."""

from __future__ import annotations

import argparse
import os
import sys


def _regenerate(args: argparse.Namespace) -> None:
    from .targets import load_target
    from .training.regenerate import regenerate_responses

    target = load_target(args.target)
    records = regenerate_responses(
        target.model, target.tokenizer, args.sources.split(","), args.output, data_dir=args.data_dir,
        limit_per_source=args.limit_per_source, max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
    )
    print(f"{len(records)} responses in {args.output}")


def _bench(args: argparse.Namespace) -> None:
    from .benchmark.bench import main as bench_main

    bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="angelspec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    regenerate = commands.add_parser("regenerate", help="regenerate training responses with the target itself")
    regenerate.add_argument("--target", default="smollm2")
    regenerate.add_argument("--sources", required=True, help="comma-separated prompt sets, e.g. alpaca_eval,arena_hard")
    regenerate.add_argument("--output", required=True, help="gzipped JSONL file, appended to (resumable)")
    regenerate.add_argument("--data-dir", default=None)
    regenerate.add_argument("--limit-per-source", type=int, default=None)
    regenerate.add_argument("--max-prompt-tokens", type=int, default=384)
    regenerate.add_argument("--max-new-tokens", type=int, default=256)
    regenerate.add_argument("--batch-size", type=int, default=16)
    regenerate.set_defaults(func=_regenerate)

    from .benchmark.bench import add_arguments

    bench = commands.add_parser("bench", help="speculative vs plain decoding on a prompt set")
    add_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
