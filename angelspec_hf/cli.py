"""`angelspec` command line: `demo`, `regenerate` training responses, `bench` drafters against plain decoding (one
sequence at a time, or batched with `--concurrency`), `profile` the verify cost D-cut plans with."""

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


DEFAULT_DRAFTER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_cards", "smollm2-135m-instruct-mtp"
)
DEMO_PROMPTS = [
    "Give me three tips for staying focused while working from home.",
    "Explain what a hash table is to a first-year student.",
    "Write a short, friendly email inviting my team to a Friday lunch.",
]


def _demo(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModel

    from .benchmark.bench import drafter_methods, format_table, run_benchmark
    from .prompts import default_data_dir, encode_chat, load_prompts
    from .targets import load_target

    target = load_target(args.target)
    drafter = AutoModel.from_pretrained(args.drafter).eval().bind_target(target.model, target.tokenizer)
    if default_data_dir() is not None:
        prompts = [row["prompt"] for row in load_prompts("mt_bench", limit=args.limit)]
    else:
        prompts = DEMO_PROMPTS[: args.limit]
    results = run_benchmark(
        target.model, target.tokenizer, drafter_methods("drafter", drafter), prompts, args.max_new_tokens
    )
    input_ids = torch.tensor([encode_chat(target.tokenizer, prompts[0])])
    sample = target.model.generate(input_ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(f"\nPrompt: {prompts[0]}\nSmolLM2 + MTP drafter: {target.tokenizer.decode(sample[0, input_ids.shape[1]:], skip_special_tokens=True)}\n")
    print(format_table(results))
    speculative = results["methods"][1]
    print(
        f"\nτ = {speculative['tau']:.2f} tokens per target forward; speedup {speculative['speedup']:.2f}x over plain "
        f"decoding ({speculative['tokens_per_s']:.1f} vs {results['methods'][0]['tokens_per_s']:.1f} tokens/s); "
        f"outputs identical on {speculative['identical_fraction']:.0%} of {len(prompts)} prompts."
    )


def _bench(args: argparse.Namespace) -> None:
    from .benchmark.bench import main as bench_main

    bench_main(args)


def _profile(args: argparse.Namespace) -> None:
    from .generation.dcut import cost_model_path, profile_verify_cost
    from .targets import load_target

    target = load_target(args.target)
    rows = [int(r) for r in args.rows.split(",")]
    model = profile_verify_cost(target.model, rows=rows, repeats=args.repeats)
    path = args.output or cost_model_path(target.model)
    model.save(path)
    print(f"verify-cost profile ({model.machine['threads']} threads) -> {path}")
    print("rows \\ tokens " + " ".join(f"{t:>7}" for t in model.tokens))
    for batch, line in zip(model.rows, model.seconds):
        print(f"{batch:>13} " + " ".join(f"{1000 * s:>5.0f}ms" for s in line))


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

    demo = commands.add_parser("demo", help="SmolLM2 with the shipped MTP drafter: outputs, τ and speedup")
    demo.add_argument("--target", default="smollm2")
    demo.add_argument("--drafter", default=DEFAULT_DRAFTER)
    demo.add_argument("--limit", type=int, default=5, help="how many MT-bench prompts")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.set_defaults(func=_demo)

    profile = commands.add_parser("profile", help="(re-)profile the target's verify-forward latency on this machine for D-cut")
    profile.add_argument("--target", default="smollm2")
    profile.add_argument("--rows", default="1,2,4,8,16,32,64", help="comma-separated batch sizes to profile")
    profile.add_argument("--repeats", type=int, default=5)
    profile.add_argument("--output", default=None, help="JSON file (default: the cache D-cut reads)")
    profile.set_defaults(func=_profile)

    from .benchmark.bench import add_arguments

    bench = commands.add_parser("bench", help="speculative vs plain decoding on a prompt set")
    add_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = "angelspec " + " ".join(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
