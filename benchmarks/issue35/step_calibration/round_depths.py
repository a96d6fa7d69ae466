"""Where D-cut's rounds go against a fixed depth: per schedule, the speedup over AR (same process, default threads),
the rounds' verified-depth histogram and their mean target forward, drafting and whole-round milliseconds.

    .venv/bin/python benchmarks/issue35/step_calibration/round_depths.py gsm8k_test 8 dcut,constant-3 \
        [--drafter smollm2-135m-instruct-suffix]
"""

import argparse
import collections
import statistics
import time

import torch

import angelspec_hf
from angelspec_hf.generation.policies import resolve_policy
from angelspec_hf.generation.session import memory_of
from angelspec_hf.hub import load_drafter
from angelspec_hf.prompts import encode_chat, load_prompts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompts")
    parser.add_argument("limit", type=int)
    parser.add_argument("schedules")
    parser.add_argument("--drafter", default="smollm2-135m-instruct-suffix")
    parser.add_argument("--data-dir", default="../shared/data")
    args = parser.parse_args()
    target = angelspec_hf.load_target("smollm2")
    model, tokenizer = target.model, target.tokenizer
    rows = load_prompts(args.prompts, data_dir=args.data_dir, limit=args.limit)
    encoded = [torch.tensor([encode_chat(tokenizer, row["prompt"])]) for row in rows]
    schedules = args.schedules.split(",")
    drafters = {}
    for schedule in schedules:  # a drafter of its own per schedule, as `angelspec bench` does
        drafter = load_drafter(args.drafter, model, tokenizer)
        for key, value in resolve_policy(schedule, drafter).generation_settings().items():
            setattr(drafter.generation_config, key, value)
        drafters[schedule] = drafter
    model.generate(encoded[0], max_new_tokens=4, do_sample=False)
    for drafter in drafters.values():
        model.generate(encoded[0], max_new_tokens=4, do_sample=False, assistant_model=drafter)
        drafter.forget_served_requests()
    seconds = collections.defaultdict(float)
    rounds = {schedule: collections.defaultdict(list) for schedule in schedules}
    settings = {"max_new_tokens": 128, "min_new_tokens": 0, "do_sample": False}
    for input_ids in encoded:
        start = time.perf_counter()
        model.generate(input_ids, **settings)
        seconds["ar"] += time.perf_counter() - start
        for schedule, drafter in drafters.items():
            start = time.perf_counter()
            output = model.generate(input_ids, **settings, assistant_model=drafter)
            seconds[schedule] += time.perf_counter() - start
            stats, record = memory_of(drafter).stats, rounds[schedule]
            record["drafted"] += stats.drafted
            record["seconds"] += stats.round_seconds
            record["tokens"].append(output.shape[1] - input_ids.shape[1])
    for schedule in schedules:
        record = rounds[schedule]
        timed = record["seconds"]
        print(
            f"{schedule}: speedup {seconds['ar'] / seconds[schedule]:.3f}, rounds {len(record['drafted'])}, "
            f"tau {sum(record['tokens']) / len(record['drafted']):.2f}, verified depths "
            f"{sorted(collections.Counter(record['drafted']).items())}, mean ms: target "
            f"{1000 * statistics.mean(f for f, _, _ in timed):.1f} draft {1000 * statistics.mean(d for _, d, _ in timed):.2f} "
            f"round {1000 * statistics.mean(w for _, _, w in timed):.1f}"
        )


if __name__ == "__main__":
    main()
