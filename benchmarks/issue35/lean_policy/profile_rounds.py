"""Where a suffix-drafter round's time outside the target forward goes: cProfile over `generate()` with the shipped
suffix drafter under D-cut (default threads), functions sorted by own time, the target's modules left out.

    .venv/bin/python benchmarks/issue35/lean_policy/profile_rounds.py [gsm8k_test|a suite domain] [4] [--drafter NAME]
"""

import argparse
import cProfile
import pstats

import torch

import angelspec_hf
from angelspec_hf.benchmark.suite import domain_or_set_prompts
from angelspec_hf.generation.session import memory_of
from angelspec_hf.hub import load_drafter
from angelspec_hf.prompts import encode_chat


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompts", nargs="?", default="gsm8k_test")
    parser.add_argument("limit", nargs="?", type=int, default=4)
    parser.add_argument("--drafter", default="smollm2-135m-instruct-suffix")
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    target = angelspec_hf.load_target("smollm2")
    model, tokenizer = target.model, target.tokenizer
    drafter = load_drafter(args.drafter, model, tokenizer)
    prompts = domain_or_set_prompts(args.prompts, args.limit, args.data_dir)
    encoded = [torch.tensor([encode_chat(tokenizer, prompt)]) for prompt in prompts]
    settings = {"max_new_tokens": 128, "do_sample": False, "assistant_model": drafter}
    model.generate(encoded[0], **{**settings, "max_new_tokens": 8})
    profiler = cProfile.Profile()
    rounds = 0
    for input_ids in encoded:
        profiler.enable()
        model.generate(input_ids, **settings)
        profiler.disable()
        rounds += len(memory_of(drafter).stats.round_seconds)
    print(f"{rounds} rounds, prompts of {sum(ids.shape[1] for ids in encoded) / len(encoded):.0f} tokens on average")
    print("round profile of the last prompt (under the profiler):", memory_of(drafter).stats.round_profile())
    stats = pstats.Stats(profiler).sort_stats("tottime")
    stats.print_stats(args.top)
    stats.sort_stats("cumulative").print_stats("angelspec_hf", args.top)
    stats.print_stats("transformers/generation|cache_utils|masking_utils", args.top)


if __name__ == "__main__":
    main()
