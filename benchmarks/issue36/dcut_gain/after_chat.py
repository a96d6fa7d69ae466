"""A drafter's D-cut after other traffic: one drafter (one memory, as a server keeps) decodes prompt sets in turn,
each prompt with AR first (greedy, 128 new tokens), and per set the speedup over AR, τ and the share of rounds
drafted are printed. DFly after MT-bench prompts, where drafting loses, on GSM8K:

    .venv/bin/python benchmarks/issue36/dcut_gain/after_chat.py dfly mt_bench:8 gsm8k_test:8
"""

import sys
import time

import torch
from common import dcut_drafter, warm_up

import angelspec_hf
from angelspec_hf.benchmark.suite import domain_or_set_prompts
from angelspec_hf.generation.session import memory_of
from angelspec_hf.prompts import encode_chat


def main():
    name, sets = sys.argv[1], [spec.split(":") for spec in sys.argv[2:]]
    target = angelspec_hf.load_target("smollm2")
    model, tokenizer = target.model, target.tokenizer
    drafter = dcut_drafter(name, model, tokenizer)
    stop = {"max_new_tokens": 128, "min_new_tokens": 0, "do_sample": False}
    warm_up(model, drafter, torch.tensor([encode_chat(tokenizer, "Hello")]))
    for prompts, limit in sets:
        ar = spec = tokens = rounds = drafted = 0
        for prompt in domain_or_set_prompts(prompts, int(limit), "../shared/data"):
            input_ids = torch.tensor([encode_chat(tokenizer, prompt)])
            start = time.perf_counter()
            reference = model.generate(input_ids, **stop)
            ar += time.perf_counter() - start
            start = time.perf_counter()
            output = model.generate(input_ids, **stop, assistant_model=drafter)
            spec += time.perf_counter() - start
            assert torch.equal(output, reference)
            stats = memory_of(drafter).stats
            tokens += output.shape[1] - input_ids.shape[1]
            rounds += len(stats.drafted)
            drafted += sum(1 for d in stats.drafted if d)
        print(f"{prompts}: {ar / spec:.3f}x, tau {tokens / rounds:.2f}, drafted {drafted}/{rounds} rounds", flush=True)


if __name__ == "__main__":
    main()
