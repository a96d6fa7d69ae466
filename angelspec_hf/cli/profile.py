"""`angelspec profile`: this machine's linear-kernel plan for the target, and the verify-forward latency D-cut
plans with."""

from __future__ import annotations

import argparse

from ..arguments import add_target_arguments, positive_int, positive_int_list
from .common import check_target_arguments, check_writable


NAME = "profile"
HELP = "(re-)profile the target's verify-forward latency on this machine for D-cut"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    parser.add_argument(
        "--rows", type=positive_int_list, default="1,2,4,8,16,32,64", help="comma-separated batch sizes to profile"
    )
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--output", default=None, help="JSON file (default: the cache D-cut reads)")


def check(args: argparse.Namespace) -> None:
    check_target_arguments(args)
    check_writable("--output", args.output)


def run(args: argparse.Namespace) -> int:
    from ..generation.kernels import tune_linear_kernels
    from ..generation.verify_cost import cost_model_path, profile_verify_cost
    from ..targets import load_target

    # loaded plain, then the kernel plan measured once (first: the verify cost is the tuned model's)
    target = load_target(args.target, dtype=args.dtype, device=args.device, tune_kernels=False)
    if args.linear_kernels == "tuned":
        plan = tune_linear_kernels(target.model, measure=True)
        if plan is not None:
            print(
                "linear kernels (rows: kernel at rows): "
                + (
                    ", ".join(f"{rows}: {name} at {padded}" for rows, (name, padded) in sorted(plan.choices.items()))
                    or "PyTorch's default everywhere"
                )
            )
    rows = sorted({int(r) for r in args.rows.split(",")})
    model = profile_verify_cost(target.model, rows=rows, repeats=args.repeats)
    path = args.output or cost_model_path(target.model)
    model.save(path)
    print(f"verify-cost profile ({model.machine['threads']} threads) -> {path}")
    print("rows \\ tokens " + " ".join(f"{t:>7}" for t in model.tokens))
    for batch, line in zip(model.rows, model.seconds):
        print(f"{batch:>13} " + " ".join(f"{1000 * s:>5.0f}ms" for s in line))
    return 0
