"""Where a router round's time goes, member by member, against the suffix drafter alone: both decode the same prompts
(greedy, D-cut, `generate(assistant_model=...)` as the suite runs them, no profiler), and for the router each member's
drafting calls are timed (rounds drafted, tries among them, tokens read, seconds), beside the rounds' wall time.

    .venv/bin/python benchmarks/issue36/router_overhead/members.py summarization 8
"""

import sys
import time
from collections import defaultdict

import torch

import angelspec_hf
from angelspec_hf.benchmark.suite import domain_or_set_prompts
from angelspec_hf.generation.policies import resolve_policy
from angelspec_hf.generation.session import memory_of
from angelspec_hf.hub import load_drafter
from angelspec_hf.models.router import modeling_router
from angelspec_hf.prompts import encode_chat


calls = defaultdict(lambda: [0, 0.0, 0])  # member: drafting calls, seconds, tokens read (the widest row's)
_draft_with = modeling_router.RouterDrafter._draft_with


def timed_draft_with(self, m, state, rows, *args):
    width = max(len(state.rows[r].members[m].tokens) for r in rows)
    start = time.perf_counter()
    result = _draft_with(self, m, state, rows, *args)
    record = calls[self.config.member_names[m]]
    record[0] += 1
    record[1] += time.perf_counter() - start
    record[2] += width
    return result


def main():
    domain, limit = sys.argv[1], int(sys.argv[2])
    target = angelspec_hf.load_target("smollm2")
    model, tokenizer = target.model, target.tokenizer
    encoded = [
        torch.tensor([encode_chat(tokenizer, p)]) for p in domain_or_set_prompts(domain, limit, "../shared/data")
    ]
    stop = {"max_new_tokens": 128, "min_new_tokens": 0, "do_sample": False}
    modeling_router.RouterDrafter._draft_with = timed_draft_with
    outputs = {}
    for name in ("suffix", "router", "suffix", "router"):
        drafter = load_drafter(f"smollm2-135m-instruct-{name}", model, tokenizer)
        for key, value in resolve_policy("dcut", drafter).generation_settings().items():
            setattr(drafter.generation_config, key, value)
        model.generate(encoded[0], max_new_tokens=4, do_sample=False, assistant_model=drafter)
        calls.clear()
        seconds, rounds, tokens, texts = 0.0, 0, 0, []
        for input_ids in encoded:
            start = time.perf_counter()
            out = model.generate(input_ids, **stop, assistant_model=drafter)
            seconds += time.perf_counter() - start
            rounds += len(memory_of(drafter).stats.drafted)
            tokens += out.shape[1] - input_ids.shape[1]
            texts.append(out[0, input_ids.shape[1] :].tolist())
        assert outputs.setdefault(name, texts) == texts
        print(
            f"{name}: {tokens} tokens in {rounds} rounds, {seconds:.1f} s: {seconds / rounds * 1e3:.1f} ms a round, "
            f"{tokens / rounds:.2f} tokens a round, {tokens / seconds:.1f} tokens/s",
            flush=True,
        )
        for member, (count, spent, read) in sorted(calls.items()):
            print(
                f"  {member}: {count} drafting calls reading {read} tokens, {spent:.2f} s "
                f"({spent / rounds * 1e3:.2f} ms a round)"
            )
    print("outputs identical:", outputs["suffix"] == outputs["router"])


if __name__ == "__main__":
    main()
