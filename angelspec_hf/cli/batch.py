"""`angelspec batch`: a prompt set served through the batched engine, responses to JSONL; exit status 1 when a
request failed."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..arguments import add_target_arguments, load_target_from_args, policy, positive_int, temperature
from .common import (
    check_context,
    check_data_dir,
    check_drafter,
    check_prompt_sources,
    check_target_arguments,
    check_writable,
)


NAME = "batch"
HELP = "serve a prompt set through the batched engine, responses to JSONL"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    parser.add_argument("--drafter", default=None, help="drafter folder (none: batched autoregressive decoding)")
    parser.add_argument("--prompts", default="mt_bench", help="prompt set name, mixture (a+b) or JSONL file")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--limit", type=positive_int, default=None)
    parser.add_argument("--concurrency", type=positive_int, default=16, help="most requests decoded together")
    parser.add_argument("--policy", type=policy, default="dcut", help="verify policy: dcut, heuristic or constant-K")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument(
        "--temperature",
        type=temperature,
        default=0.0,
        help="0 (default): greedy decoding; > 0: sample at this temperature",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="JSONL of responses")


def check(args: argparse.Namespace) -> None:
    check_target_arguments(args)
    check_drafter(args.drafter)
    check_context(args)
    check_data_dir(args.data_dir)
    check_prompt_sources([args.prompts], args.data_dir)
    check_writable("--output", args.output)


def run(args: argparse.Namespace) -> int:
    from ..generation.engine import Request, SpeculativeEngine
    from ..hub import load_drafter
    from ..prompts import encode_chat, load_prompts

    target = load_target_from_args(args)
    drafter = None
    if args.drafter:
        drafter = load_drafter(args.drafter, target.model, target.tokenizer)
    rows = load_prompts(args.prompts, data_dir=args.data_dir, limit=args.limit)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {}
    requests = [
        Request(
            encode_chat(target.tokenizer, row["prompt"], row.get("history")),
            max_new_tokens=args.max_new_tokens,
            seed=args.seed + i,
            request_id=i,
            **sampling,
        )
        for i, row in enumerate(rows)
    ]
    engine = SpeculativeEngine(target.model, drafter, policy=args.policy, max_batch_size=args.concurrency)
    outputs = engine.generate(requests, progress=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as handle:
        for row, output in zip(rows, outputs):
            record = {
                "prompt": row["prompt"],
                "response": target.tokenizer.decode(output.output_ids, skip_special_tokens=True),
                "new_tokens": len(output.output_ids),
                "finish_reason": output.finish_reason,
                "error": output.error,
                "tau": output.stats.tau,
            }
            handle.write(json.dumps(record) + "\n")
    stats = engine.stats
    print(
        f"{len(outputs)} requests, {stats.generated_tokens} tokens in {stats.seconds:.1f} s "
        f"({stats.generated_tokens / stats.seconds:.1f} tokens/s, up to {stats.peak_rows} at once) -> {args.output}"
    )
    failed = [output for output in outputs if output.finish_reason == "error"]
    if failed:
        print(
            f'angelspec batch: {len(failed)} of {len(outputs)} requests failed (finish_reason "error" in '
            f"{args.output}; the first: {failed[0].error})",
            file=sys.stderr,
        )
        return 1
    return 0
