"""Where the router's rounds spend their extra time over the suffix drafter alone: both decode the same prompts
(greedy, D-cut, as the suite runs them) under cProfile, and for each the package's functions are listed by their
own time per round, largest differences first.

    .venv/bin/python benchmarks/issue36/router_overhead/own_time.py gsm8k_test 4
"""

import cProfile
import pstats
import sys

import torch

import angelspec_hf
from angelspec_hf.benchmark.suite import domain_or_set_prompts
from angelspec_hf.generation.policies import resolve_policy
from angelspec_hf.generation.session import memory_of
from angelspec_hf.hub import load_drafter
from angelspec_hf.prompts import encode_chat


def own_times(profile: cProfile.Profile) -> dict[str, float]:
    """Seconds each function spent in its own code (callees excluded), keyed by file:function; outside the
    package, by function only."""
    times = {}
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(profile).stats.items():
        where = path.split("angelspec_hf/")[-1] if "angelspec_hf/" in path else "(outside)"
        key = f"{where}:{name}" if where != "(outside)" else f"(outside) {name}"
        times[key] = times.get(key, 0.0) + own
    return times


def decoding_setup(domain: str, limit: int):
    """(target model, tokenizer, the first `limit` prompts of `domain` chat-encoded, greedy 128-token settings)."""
    target = angelspec_hf.load_target("smollm2")
    model, tokenizer = target.model, target.tokenizer
    encoded = [
        torch.tensor([encode_chat(tokenizer, p)]) for p in domain_or_set_prompts(domain, limit, "../shared/data")
    ]
    return model, tokenizer, encoded, {"max_new_tokens": 128, "min_new_tokens": 0, "do_sample": False}


def warm_dcut_drafter(name: str, model, tokenizer, input_ids: torch.Tensor):
    """The shipped card `smollm2-135m-instruct-<name>` under D-cut, warmed up on a few tokens of `input_ids`."""
    drafter = load_drafter(f"smollm2-135m-instruct-{name}", model, tokenizer)
    for key, value in resolve_policy("dcut", drafter).generation_settings().items():
        setattr(drafter.generation_config, key, value)
    model.generate(input_ids, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    return drafter


def main():
    model, tokenizer, encoded, stop = decoding_setup(sys.argv[1], int(sys.argv[2]))
    per_round = {}
    for name in ("suffix", "router"):
        drafter = warm_dcut_drafter(name, model, tokenizer, encoded[0])
        profile, rounds = cProfile.Profile(), 0
        for input_ids in encoded:
            profile.enable()
            model.generate(input_ids, **stop, assistant_model=drafter)
            profile.disable()
            rounds += len(memory_of(drafter).stats.drafted)
        per_round[name] = {key: seconds / rounds * 1e3 for key, seconds in own_times(profile).items()}
        print(f"{name}: {rounds} rounds, {sum(per_round[name].values()):.2f} ms a round under the profiler")
    keys = set(per_round["suffix"]) | set(per_round["router"])
    rows = sorted(keys, key=lambda k: per_round["router"].get(k, 0.0) - per_round["suffix"].get(k, 0.0), reverse=True)
    print(f"{'function':<80} {'suffix':>7} {'router':>7}  ms a round (own time)")
    for key in rows[:30]:
        print(f"{key[:80]:<80} {per_round['suffix'].get(key, 0.0):7.3f} {per_round['router'].get(key, 0.0):7.3f}")


if __name__ == "__main__":
    main()
