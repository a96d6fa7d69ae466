"""`angelspec demo`: SmolLM2 with a shipped drafter on a few MT-bench prompts: a sample output, τ and speedup."""

from __future__ import annotations

import argparse

from ..arguments import add_target_arguments, load_target_from_args, positive_int
from .common import check_context, check_drafter, check_target_arguments


NAME = "demo"
HELP = "SmolLM2 with a shipped drafter (the suffix one): outputs, τ and speedup"
DEFAULT_DRAFTER = "smollm2-135m-instruct-suffix"  # a shipped card (the fastest on MT-bench): load_drafter finds it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER, help="a drafter folder, shipped drafter name or Hub id")
    parser.add_argument("--limit", type=positive_int, default=5, help="how many MT-bench prompts")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)


def check(args: argparse.Namespace) -> None:
    check_target_arguments(args)
    check_drafter(args.drafter)
    check_context(args)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..benchmark.bench import drafter_methods, format_table, run_benchmark
    from ..hub import load_drafter
    from ..prompts import encode_chat, load_prompts

    target = load_target_from_args(args)
    drafter = load_drafter(args.drafter, target.model, target.tokenizer)
    prompts = [row["prompt"] for row in load_prompts("mt_bench", limit=args.limit)]  # shipped with the package
    results = run_benchmark(
        target.model, target.tokenizer, drafter_methods("drafter", drafter), prompts, args.max_new_tokens
    )
    input_ids = torch.tensor([encode_chat(target.tokenizer, prompts[0])])
    sample = target.model.generate(
        input_ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False
    )
    print(
        f"\nPrompt: {prompts[0]}\nSmolLM2 + {drafter.config.drafter_kind} drafter: {target.tokenizer.decode(sample[0, input_ids.shape[1] :], skip_special_tokens=True)}\n"
    )
    print(format_table(results))
    speculative = results["methods"][1]
    print(
        f"\nτ = {speculative['tau']:.2f} tokens per target forward; speedup {speculative['speedup']:.2f}x over plain "
        f"decoding ({speculative['tokens_per_s']:.1f} vs {results['methods'][0]['tokens_per_s']:.1f} tokens/s); "
        f"outputs identical on {speculative['identical_fraction']:.0%} of {len(prompts)} prompts."
    )
    return 0
