"""`angelspec estimate`: a drafter's acceptance measured offline on held-out target responses (no target
decoding)."""

from __future__ import annotations

import argparse
import json
import os

from ..arguments import add_target_arguments, load_target_from_args, positive_int
from .common import UsageError, check_drafter, check_target_arguments, check_writable


NAME = "estimate"
HELP = "offline acceptance estimate of a drafter on held-out target responses (no target decoding)"
DEFAULT_HELDOUT = os.path.join(  # package data: an installed wheel has it
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "data",
    "smollm2-135m-instruct",
    "heldout_responses.jsonl.gz",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True)
    add_target_arguments(parser)
    parser.add_argument(
        "--responses", default=DEFAULT_HELDOUT, help="held-out target responses (angelspec regenerate)"
    )
    parser.add_argument("--sources", default=None, help="only these sources of the responses file, comma-separated")
    parser.add_argument("--num-draft-tokens", type=positive_int, default=None, help="default: the drafter's own")
    parser.add_argument("--max-length", type=positive_int, default=1024, help="tokens per packed row")
    parser.add_argument("--hidden-cache-dir", default=os.path.join(".cache", "hidden_states"))
    parser.add_argument("--output", default=None, help="JSON file of the metrics")
    parser.add_argument(
        "--write-prior",
        action="store_true",
        help="save the measured P(first k drafts accepted) in the drafter folder's generation_config.json, where "
        "D-cut starts from it (dcut_prior_acceptance)",
    )


def check(args: argparse.Namespace) -> None:
    check_target_arguments(args)
    check_drafter(args.drafter)
    check_estimable(args.drafter)
    if not all(os.path.isfile(path) for path in args.responses.split(",")):
        raise UsageError(f"--responses {args.responses}: no such file (make one with `angelspec regenerate`)")
    check_writable("--output", args.output)
    if args.write_prior and not os.path.isdir(args.drafter):
        raise UsageError(f"--write-prior writes into a local drafter folder; {args.drafter} is not one")


def check_estimable(drafter: str) -> None:
    """The drafter predicts drafts from target states (MTP, DFly, DFlash), which the estimate replays over the
    held-out responses: read from its config, before the target is loaded and its states computed."""
    from transformers import AutoConfig

    from ..hub import resolve_drafter
    from ..models import DRAFTER_CLASSES

    try:
        model_type = AutoConfig.from_pretrained(resolve_drafter(drafter)).model_type
    except (OSError, ValueError):  # no readable config: loading the drafter reports what is wrong with it
        return
    model_class = DRAFTER_CLASSES[model_type][1] if model_type in DRAFTER_CLASSES else None
    if model_class is not None and not model_class.has_training_forward:
        raise UsageError(
            f"--drafter {drafter}: a {model_class.__name__} drafts without a forward over target states, which the "
            "offline estimate replays; measure it with `angelspec bench`"
        )


def run(args: argparse.Namespace) -> int:
    from ..hub import load_drafter
    from ..training import estimate_on_responses

    target = load_target_from_args(args)
    drafter = load_drafter(args.drafter, target.model, target.tokenizer)
    sources = args.sources.split(",") if args.sources else None
    metrics = estimate_on_responses(
        drafter, target.model, args.responses, sources, args.max_length, args.hidden_cache_dir, args.num_draft_tokens
    )
    depths = args.num_draft_tokens or drafter.generation_config.num_assistant_tokens
    print(f"{metrics['documents']} responses, {metrics['rounds']} rounds of greedy decoding, offline")
    print(
        f"τ {metrics['tau']:.3f}; by draft length: "
        + " ".join(f"{d}:{metrics[f'tau_depth_{d}']:.2f}" for d in range(1, depths + 1))
    )
    print(
        "acceptance by depth: "
        + " ".join(f"{metrics.get(f'acceptance_depth_{d}', 0.0):.2f}" for d in range(1, depths + 1))
    )
    for n in (1, 2, 4, 8):
        print(
            f"top-{n} recall by depth: "
            + " ".join(f"{metrics[f'recall_top{n}_depth_{d}']:.2f}" for d in range(1, depths + 1))
        )
    if args.write_prior:
        prior = prefix_acceptance(metrics, depths)
        drafter.generation_config.dcut_prior_acceptance = prior
        drafter.generation_config.save_pretrained(args.drafter)
        print(f"D-cut prior (P(first k drafts accepted)) written to {args.drafter}: {[round(p, 3) for p in prior]}")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"command": args.command_line, "drafter": args.drafter, **metrics}, handle, indent=1)
    return 0


def prefix_acceptance(metrics: dict, depths: int) -> list[float]:
    """P(the first k drafts are accepted), k = 1..depths: the steps of the offline τ by draft length (τ_k − τ_(k−1),
    τ_0 = 1), made non-increasing."""
    taus = [1.0] + [metrics[f"tau_depth_{d}"] for d in range(1, depths + 1)]
    steps, lowest = [], 1.0
    for before, after in zip(taus, taus[1:]):
        lowest = min(lowest, max(0.0, after - before))
        steps.append(lowest)
    return steps
