"""`angelspec teacher-forced`: existing text (prompt sets' own answers, Python sources) as training responses."""

from __future__ import annotations

import argparse
import os

from ..arguments import positive_int
from ..prompts import PROMPT_SETS
from .common import UsageError, check_data_dir, check_target, check_writable


NAME = "teacher-forced"
HELP = "existing text (prompt sets' own answers, Python sources) as training responses"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2", help="whose tokenizer and chat template")
    parser.add_argument("--sources", default="", help="comma-separated prompt sets with answers, e.g. gsm8k_train")
    parser.add_argument("--python-source", default=None, help="a folder of .py files ('stdlib': Python's own)")
    parser.add_argument("--output", required=True, help="gzipped JSONL file (replaced)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--limit-per-source", type=positive_int, default=None)
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    parser.add_argument("--max-response-tokens", type=positive_int, default=1024)
    parser.add_argument("--chunk-tokens", type=positive_int, default=768, help="tokens per Python-source response")


def check(args: argparse.Namespace) -> None:
    check_target(args.target)
    check_data_dir(args.data_dir)
    unknown = [s for s in args.sources.split(",") if s and getattr(PROMPT_SETS.get(s), "reference", None) is None]
    if unknown:
        answered = ", ".join(name for name, spec in PROMPT_SETS.items() if spec.reference is not None)
        raise UsageError(f"--sources: {', '.join(unknown)} has no answers of its own; these do: {answered}")
    if not args.sources and args.python_source is None:
        raise UsageError("nothing to read: give --sources and/or --python-source")
    if args.python_source not in (None, "stdlib") and not os.path.isdir(args.python_source):
        raise UsageError(f"--python-source {args.python_source}: no such folder")
    check_writable("--output", args.output)


def run(args: argparse.Namespace) -> int:
    import sysconfig

    from ..targets import load_target_tokenizer
    from ..training.regenerate import teacher_forced_responses

    python_source = sysconfig.get_paths()["stdlib"] if args.python_source == "stdlib" else args.python_source
    records = teacher_forced_responses(
        load_target_tokenizer(args.target),
        [s for s in args.sources.split(",") if s],
        args.output,
        data_dir=args.data_dir,
        limit_per_source=args.limit_per_source,
        max_prompt_tokens=args.max_prompt_tokens,
        max_response_tokens=args.max_response_tokens,
        python_source=python_source,
        chunk_tokens=args.chunk_tokens,
    )
    tokens = sum(len(record["response_ids"]) for record in records)
    print(f"{len(records)} teacher-forced responses, {tokens} response tokens, in {args.output}")
    return 0
