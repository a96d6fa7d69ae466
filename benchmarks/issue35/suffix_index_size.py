"""Issue 35, the suffix drafter's median: does a larger shared index (more of the target's earlier outputs) raise τ?

Replays the held-out greedy responses (the package's heldout_responses, the benchmark sets) as greedy speculative
decoding with a constant draft of `k` tokens: a draft token is accepted when it equals the response's next token
(the responses are the target's own greedy output, so no target forward is needed), and each response is recorded
into the shared index after it is decoded, as the benchmark's requests are. τ = response tokens / target forwards
(the prefill counted as one, as `generate()` counts it).

    python benchmarks/issue35/suffix_index_size.py DRAFTER_DIR mt_bench,arena_hard,gsm8k_test,mbpp_test 8

The larger index was made from every committed regeneration file (data/README.md) with
    angelspec index-outputs --drafter model_cards/smollm2-135m-instruct-suffix --max-tokens 4194304 \
        --responses data/smollm2-135m-instruct/*.jsonl.gz (comma-separated) \
        --exclude mt_bench,spec_bench,gsm8k_test,mbpp_test,arena_hard --data-dir ../shared/data --output /tmp/suffix_all
"""

import gzip
import json
import os
import sys
import time

import torch

from angelspec_hf import SuffixDrafter


HELDOUT = os.path.join(
    os.path.dirname(__file__),
    "..",
    "..",
    "angelspec_hf",
    "data",
    "smollm2-135m-instruct",
    "heldout_responses.jsonl.gz",
)


def replay(drafter: SuffixDrafter, prompt: list[int], response: list[int], k: int) -> int:
    """Target forwards greedy decoding of `response` takes with `k` drafts a round."""
    state = drafter.new_draft_state(1)
    new, position, forwards = prompt + response[:1], 1, 1
    while position < len(response):
        count = min(k, len(response) - position - 1)
        drafted = []  # the last token is the bonus of the round before: nothing to draft after it
        if count:  # the drafter stops early where no match is left
            drafted = drafter.propose(state, (), torch.tensor([new]), count, lambda logits: logits.argmax(-1))[0]
            drafted = drafted[0].tolist()
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == response[position + accepted]:
            accepted += 1
        new = response[position : position + accepted + 1]
        position, forwards = position + accepted + 1, forwards + 1
    return forwards


def main(path: str, sources: list[str], k: int) -> None:
    drafter = SuffixDrafter.from_pretrained(path)
    with gzip.open(HELDOUT, "rt") as handle:
        records = [json.loads(line) for line in handle]
    started = time.perf_counter()
    for source in sources:
        tokens = forwards = 0
        for record in (r for r in records if r["source"] == source):
            response = record["response_ids"][:128]
            forwards += replay(drafter, record["prompt_ids"], response, k)
            tokens += len(response)
            drafter.record_output(response)
        print(source, "tau", round(tokens / forwards, 3), f"{time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]))
