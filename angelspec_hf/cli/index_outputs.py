"""`angelspec index-outputs`: a suffix drafter's shared index seeded with the target's responses (a datastore)."""

from __future__ import annotations

import argparse
import json
import os

from ..arguments import positive_int
from .common import UsageError, check_data_dir, check_drafter, check_prompt_sources, check_writable


NAME = "index-outputs"
HELP = "seed a suffix drafter's shared index with the target's responses (a datastore)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, help="a suffix drafter, or a router with a suffix member")
    parser.add_argument(
        "--responses", required=True, help="regenerated-responses files (gzipped JSONL), comma-separated"
    )
    parser.add_argument("--max-tokens", type=positive_int, default=None, help="the index's bound (default: kept)")
    parser.add_argument(
        "--exclude", default=None, help="prompt sets (comma-separated) whose prompts' responses are left out"
    )
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--output", required=True, help="the folder to save the drafter with its index to")


def check(args: argparse.Namespace) -> None:
    check_drafter(args.drafter)
    check_data_dir(args.data_dir)
    check_prompt_sources(args.exclude.split(",") if args.exclude else [], args.data_dir)
    check_writable("--output", args.output, folder=True)  # a drafter folder


def run(args: argparse.Namespace) -> int:
    from ..hub import load_drafter
    from ..models.router.modeling_router import RouterDrafter
    from ..models.suffix.modeling_suffix import SuffixDrafter
    from ..training.regenerate import read_responses

    missing = [path for path in args.responses.split(",") if not os.path.isfile(path)]
    if missing:
        raise UsageError(f"--responses: no such file {missing[0]}")
    drafter = load_drafter(args.drafter)
    suffix = drafter
    if isinstance(drafter, RouterDrafter):  # the router's suffix member
        suffix = next((member for member in drafter.members if isinstance(member, SuffixDrafter)), None)
    if not isinstance(suffix, SuffixDrafter):
        raise UsageError(f"--drafter {args.drafter}: neither a suffix drafter nor a router with a suffix member")
    records = []
    for path in args.responses.split(","):
        ours = read_responses(path)
        if not ours:  # not gzipped JSONL, or no complete record in it: seeding nothing is not what was asked
            raise UsageError(f"--responses {path}: no responses in it (a gzipped JSONL of records with response_ids)")
        for record in ours:
            ids = record["response_ids"]
            record["response_ids"] = ids if isinstance(ids, list) else json.loads(ids)
        try:  # an id the target cannot read would break decoding for every request matching its text
            suffix.check_token_ids([record["response_ids"] for record in ours], path)
        except ValueError as error:
            raise UsageError(str(error)) from None
        records += ours
    if args.exclude:  # evaluation prompts: their responses would replay the answers a benchmark asks for
        from ..prompts import normalize_prompt, prompts_of

        excluded = prompts_of(args.exclude.split(","), data_dir=args.data_dir)
        kept = [record for record in records if normalize_prompt(record["prompt"]) not in excluded]
        print(f"{len(records) - len(kept)} responses left out: their prompts are in {args.exclude}")
        records = kept
    responses = [record["response_ids"] for record in records]
    suffix.index_outputs(responses, args.max_tokens)
    drafter.save_pretrained(args.output)
    print(
        f"{len(responses)} responses into the shared index of {args.output}: "
        f"{len(suffix.shared_index)} tokens (at most {suffix.config.shared_index_max_tokens})"
    )
    return 0
