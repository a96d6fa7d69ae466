"""`angelspec regenerate`: training responses decoded by the target itself."""

from __future__ import annotations

import argparse

from ..arguments import add_target_arguments, int_list, load_target_from_args, positive_int, temperature
from .common import check_data_dir, check_prompt_sources, check_target_arguments, check_writable


NAME = "regenerate"
HELP = "regenerate training responses with the target itself"
DTYPES = ("float32", "bfloat16")  # what --dtype auto chooses between


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser, auto_dtype="decodes --batch-size rows")
    parser.add_argument("--sources", required=True, help="comma-separated prompt sets, e.g. alpaca_eval,arena_hard")
    parser.add_argument("--output", required=True, help="gzipped JSONL file, appended to (resumable)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--limit-per-source", type=positive_int, default=None)
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--batch-size", type=positive_int, default=16, help="requests decoded together (refilled)")
    parser.add_argument(
        "--temperature", type=temperature, default=0.0, help="0 (default): greedy; > 0: sampled, one seed per prompt"
    )
    parser.add_argument(
        "--seed",
        type=int_list,
        default=[0],
        help="first sampling seed (prompt i gets seed + i); several, comma-separated, are several passes in one run "
        "(a prompt's samples share its prefill)",
    )
    parser.add_argument(
        "--exclude",
        default=None,
        help="prompt sets (comma-separated, e.g. the evaluation sets) whose prompts are skipped",
    )


def check(args: argparse.Namespace) -> None:
    check_target_arguments(args)
    check_data_dir(args.data_dir)
    check_prompt_sources(args.sources.split(",") + (args.exclude.split(",") if args.exclude else []), args.data_dir)
    check_writable("--output", args.output)


def run(args: argparse.Namespace) -> int:
    from ..cache_utils import growing_cache
    from ..generation.verify_cost import profile_verify_cost
    from ..training.regenerate import mean_attended_context, regenerate_responses

    target = load_target_from_args(args) if args.dtype != "auto" else faster_target(args)
    records = regenerate_responses(
        target.model,
        target.tokenizer,
        args.sources.split(","),
        args.output,
        data_dir=args.data_dir,
        limit_per_source=args.limit_per_source,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        seed=args.seed,
        exclude=args.exclude.split(",") if args.exclude else (),
    )
    print(f"{len(records)} responses in {args.output}")
    rows = args.batch_size
    # Measured now, at exactly this many rows, not read off D-cut's cached profile: that one interpolates between its
    # profiled row counts and may have been taken under other load (48 rows in bf16, 2026-12-07: 335 tokens/s from
    # it, 475 measured afresh on the idle machine). The forwards write into the engine's own cache, and take the
    # median of 9: one forward of 48 rows varied from 116 to 165 ms on a shared 2-core machine.
    bound = {"repeats": 9, "progress": False, "new_cache": growing_cache}
    step = profile_verify_cost(target.model, rows=[rows], tokens=[1], **bound)
    print(
        f"the bound of batched decoding on this machine ({rows} rows per forward): {rows / step(rows, 1):.0f} tokens/s"
    )
    # Attending over a longer context costs more (the KV cache is read at every step): the bound at the context
    # these responses were decoded at, which a perfect refill of rows of that length would reach.
    context = mean_attended_context(records)
    if context:
        step = profile_verify_cost(target.model, rows=[rows], tokens=[1], context=context, **bound)
        print(f"at these responses' mean attended context ({context} tokens): {rows / step(rows, 1):.0f} tokens/s")
    return 0


def faster_target(args: argparse.Namespace):
    """`--dtype auto`: the target loaded in bfloat16 where it decodes `--batch-size` rows at least `MIN_SPEEDUP`
    faster than in float32 on this machine (measured: machines differ, `training.precision`), else in float32."""
    from ..training.precision import MIN_SPEEDUP, decode_seconds

    loaded = {dtype: load_target_from_args(argparse.Namespace(**{**vars(args), "dtype": dtype})) for dtype in DTYPES}
    fp32, bf16 = decode_seconds(loaded["float32"].model, loaded["bfloat16"].model, rows=args.batch_size)
    speedup = fp32 / bf16
    dtype = "bfloat16" if speedup >= MIN_SPEEDUP else "float32"
    print(f"--dtype auto: bfloat16 decodes {args.batch_size} rows {speedup:.2f}x as fast as float32 here: {dtype}")
    return loaded[dtype]
