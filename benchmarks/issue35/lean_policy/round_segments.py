"""Where a round's rest goes, by segment, against the tokens the round accepted: timestamps around the candidate
generator's calls and the target forward (its hooks) in `generate()` with the shipped suffix drafter under D-cut,
default threads, no profiler. Medians in ms per number of accepted drafts.

    .venv/bin/python benchmarks/issue35/lean_policy/round_segments.py [translation] [4]
"""

import argparse
import collections
import statistics
import time

import torch

import angelspec_hf
from angelspec_hf.benchmark.suite import domain_or_set_prompts
from angelspec_hf.generation.candidate_generator import AngelSpecCandidateGenerator
from angelspec_hf.hub import load_drafter
from angelspec_hf.prompts import encode_chat


SEGMENTS = ("propose_rest", "before_forward", "forward", "after_forward", "update", "loop_end")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompts", nargs="?", default="translation")
    parser.add_argument("limit", nargs="?", type=int, default=4)
    parser.add_argument("--drafter", default="smollm2-135m-instruct-suffix")
    parser.add_argument("--data-dir", default="../shared/data")
    args = parser.parse_args()
    target = angelspec_hf.load_target("smollm2")
    model, tokenizer = target.model, target.tokenizer
    drafter = load_drafter(args.drafter, model, tokenizer)
    prompts = domain_or_set_prompts(args.prompts, args.limit, args.data_dir)
    marks = []  # (name, time)
    get_candidates, update = (
        AngelSpecCandidateGenerator.get_candidates,
        AngelSpecCandidateGenerator.update_candidate_strategy,
    )

    def timed_get(self, *a, **k):
        marks.append(("get", time.perf_counter()))
        out = get_candidates(self, *a, **k)
        marks.append(("got", time.perf_counter(), self.drafting.seconds if self.drafting is not None else 0.0))
        return out

    def timed_update(self, input_ids, scores, num_matches):
        marks.append(("update", time.perf_counter()))
        update(self, input_ids, scores, num_matches)
        marks.append(("updated", time.perf_counter(), int(num_matches)))

    AngelSpecCandidateGenerator.get_candidates = timed_get
    AngelSpecCandidateGenerator.update_candidate_strategy = timed_update
    model.register_forward_pre_hook(lambda *a: marks.append(("fwd", time.perf_counter())), prepend=True)
    model.register_forward_hook(lambda *a: marks.append(("fwd_end", time.perf_counter())))
    settings = {"max_new_tokens": 128, "do_sample": False, "assistant_model": drafter}
    model.generate(torch.tensor([encode_chat(tokenizer, prompts[0])]), **{**settings, "max_new_tokens": 8})
    by_accepted = collections.defaultdict(lambda: collections.defaultdict(list))
    for prompt in prompts:
        marks.clear()
        model.generate(torch.tensor([encode_chat(tokenizer, prompt)]), **settings)
        # rounds: get .. got .. fwd .. fwd_end .. update .. updated .. (next) get
        names = [m[0] for m in marks]
        for i, name in enumerate(names):
            if (
                name != "get"
                or i + 6 >= len(names)
                or names[i + 1 : i + 7] != ["got", "fwd", "fwd_end", "update", "updated", "get"]
            ):
                continue
            get, got, fwd, fwd_end, upd, updated, nxt = marks[i : i + 7]
            segment = by_accepted[updated[2]]
            segment["propose_rest"].append(got[1] - get[1] - got[2])
            segment["before_forward"].append(fwd[1] - got[1])
            segment["forward"].append(fwd_end[1] - fwd[1])
            segment["after_forward"].append(upd[1] - fwd_end[1])
            segment["update"].append(updated[1] - upd[1])
            segment["loop_end"].append(nxt[1] - updated[1])
    print(f"{args.prompts}: ms per round segment (median), by drafts accepted")
    print("accepted rounds " + " ".join(f"{name:>15s}" for name in SEGMENTS))
    for accepted in sorted(by_accepted):
        segment = by_accepted[accepted]
        print(
            f"{accepted:8d} {len(segment['forward']):6d} "
            + " ".join(f"{1000 * statistics.median(segment[name]):15.2f}" for name in SEGMENTS)
        )


if __name__ == "__main__":
    main()
