"""Does D-cut stop drafting for a learned drafter part-way through a domain, and stay stopped? For each prompt in
turn (as the suite runs them: AR then the drafter, D-cut, greedy), print the drafter's tokens a round, the share of rounds it
drafted, its speedup over AR on that prompt, and ĝ (D-cut's average saved fraction of a drafting round, one row) after
the prompt: ĝ < 0 stops drafting except for exploration rounds (`policies.DCut.drafting_pays`).

    .venv/bin/python benchmarks/issue36/dcut_gain/trace.py dfly math_reasoning 16
"""

import time

import torch
from common import arguments, dcut_run

from angelspec_hf.generation.session import memory_of


def main():
    model, drafter, encoded, stop = dcut_run(arguments().parse_args())
    print("prompt  tokens/round  drafted rounds  speedup  g_hat")
    for i, input_ids in enumerate(encoded):
        start = time.perf_counter()
        reference = model.generate(input_ids, **stop)
        ar = time.perf_counter() - start
        start = time.perf_counter()
        output = model.generate(input_ids, **stop, assistant_model=drafter)
        spec = time.perf_counter() - start
        memory = memory_of(drafter)
        stats = memory.stats
        new = output.shape[1] - input_ids.shape[1]
        rounds = len(stats.drafted)
        drafted = sum(1 for d in stats.drafted if d)
        gain = memory.estimates.drafting_gain.get(1)
        assert torch.equal(output, reference), f"prompt {i}: output differs from AR"
        print(
            f"{i:>6} {new / max(rounds, 1):5.2f} {drafted:>4}/{rounds:<4} {ar / spec:7.2f}x "
            f"{'none' if gain is None else f'{gain:+.3f}'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
