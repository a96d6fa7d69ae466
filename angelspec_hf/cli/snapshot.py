"""`angelspec snapshot`: a training run's best checkpoint as a card (float16 weights, config, the run's history), the
card a run on another machine continues from (`continue_from`)."""

from __future__ import annotations

import argparse
import os

from .common import UsageError, check_writable


NAME = "snapshot"
HELP = "a training run's best checkpoint as a float16 card that carries the run's history (to commit, to continue)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a training output folder (its checkpoint-N folders)")
    parser.add_argument("--output", required=True, help="the card folder; its README and records stay")
    parser.add_argument(
        "--replace",
        action="store_true",
        help="write even when the card holds a drafter of no recorded run, or one with a higher offline τ",
    )


def check(args: argparse.Namespace) -> None:
    if not os.path.isdir(args.run):
        raise UsageError(f"{args.run}: no such training output folder")
    check_writable("--output", args.output, folder=True)


def run(args: argparse.Namespace) -> int:
    from transformers import TrainerState
    from transformers.trainer import TRAINER_STATE_NAME

    from ..training.continuation import best_checkpoint, evaluated_tau, snapshot_run

    try:
        checkpoint, state = best_checkpoint(args.run)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from None
    tau = evaluated_tau(state)
    card_state = os.path.join(args.output, TRAINER_STATE_NAME)
    if not args.replace:
        if os.path.isfile(card_state):
            card_tau = evaluated_tau(TrainerState.load_from_json(card_state))
            if card_tau is not None and card_tau >= tau:
                print(f"{args.output} keeps its drafter: offline τ {card_tau:.3f} ≥ {tau:.3f} ({checkpoint})")
                return 0
        elif os.path.isfile(os.path.join(args.output, "config.json")):
            raise UsageError(
                f"--output {args.output} holds a drafter with no recorded run: compare it with `angelspec estimate` "
                "and pass --replace to write over it"
            )
    written = snapshot_run(args.run, args.output)
    print(
        f"{written['card']}: step {written['step']} of {args.run}, offline τ {written['eval_tau']:.3f}, "
        f"{written['cpu_hours']:.2f} CPU-hours, {written['tokens']:,} tokens"
    )
    return 0
