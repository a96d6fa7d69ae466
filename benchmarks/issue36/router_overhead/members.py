"""Where a router round's time goes, member by member, against the suffix drafter alone: both decode the same prompts
(greedy, D-cut, `generate(assistant_model=...)` as the suite runs them, no profiler), and for the router each member's
drafting calls and its free readers' reading calls (`_read_with`) are counted and timed (calls, tokens read,
seconds), beside the rounds' wall time.

    .venv/bin/python benchmarks/issue36/router_overhead/members.py summarization 8
"""

import sys
import time
from collections import defaultdict

from own_time import decoding_setup, warm_dcut_drafter

from angelspec_hf.generation.session import memory_of
from angelspec_hf.models.router import modeling_router


calls = defaultdict(lambda: [0, 0.0, 0])  # (member, kind): calls, seconds, tokens read (the widest row's)
KINDS = {"_draft_with": "drafting", "_read_with": "reading"}  # the router's calls into its members


def timed(call):
    """`RouterDrafter._draft_with` or `_read_with`, counted and timed per member."""
    original = getattr(modeling_router.RouterDrafter, call)

    def timed_call(self, m, state, rows, *args):
        width = max(len(state.rows[r].members[m].tokens) for r in rows)
        start = time.perf_counter()
        result = original(self, m, state, rows, *args)
        record = calls[self.config.member_names[m], KINDS[call]]
        record[0] += 1
        record[1] += time.perf_counter() - start
        record[2] += width
        return result

    return timed_call


def main():
    model, tokenizer, encoded, stop = decoding_setup(sys.argv[1], int(sys.argv[2]))
    for call in KINDS:
        setattr(modeling_router.RouterDrafter, call, timed(call))
    outputs = {}
    for name in ("suffix", "router", "suffix", "router"):
        drafter = warm_dcut_drafter(name, model, tokenizer, encoded[0])
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
        for (member, call), (count, spent, read) in sorted(calls.items()):
            print(
                f"  {member}: {count} {call} calls reading {read} tokens, {spent:.2f} s "
                f"({spent / rounds * 1e3:.2f} ms a round)"
            )
    print("outputs identical:", outputs["suffix"] == outputs["router"])


if __name__ == "__main__":
    main()
