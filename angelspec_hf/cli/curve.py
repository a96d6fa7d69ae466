"""`angelspec curve`: offline τ of training runs against CPU-hours and tokens, as a table and a plot."""

from __future__ import annotations

import argparse
import os

from .common import UsageError, check_writable


NAME = "curve"
HELP = "offline τ of training runs against CPU-hours and tokens: table and plot"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs", nargs="+", help="training output folders (their trainer_state.json), or trainer state files"
    )
    parser.add_argument("--labels", default=None, help="comma-separated, one per run (default: the folder names)")
    parser.add_argument(
        "--target-tau",
        type=float,
        default=None,
        help="draw this τ as a line, and print the CPU-hours and tokens at which each run's trend reaches it",
    )
    parser.add_argument("--output", default=None, help="PNG of the curves")


def check(args: argparse.Namespace) -> None:
    missing = [run for run in args.runs if not os.path.exists(run)]
    if missing:
        raise UsageError(f"{missing}: no such training output folder or trainer state file")
    check_writable("--output", args.output)


def run(args: argparse.Namespace) -> int:
    from ..training.curves import curve_table, plot_training_curves, training_curve, trend_table

    labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.normpath(run)) for run in args.runs]
    if len(labels) != len(args.runs):
        raise UsageError(f"--labels names {len(labels)} runs, {len(args.runs)} were given")
    curves = {label: training_curve(run) for label, run in zip(labels, args.runs)}
    print(curve_table(curves))
    if args.target_tau is not None:
        print("\nTrends (τ against the logarithm of CPU-hours and of tokens, over each run's later half):")
        print(trend_table(curves, args.target_tau))
    if args.output:
        print(f"-> {plot_training_curves(curves, args.output, target_tau=args.target_tau)}")
    return 0
