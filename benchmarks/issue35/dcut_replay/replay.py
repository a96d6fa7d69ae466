"""Offline: D-cut's rounds on the suffix drafter, replayed on the target's greedy held-out responses without the
target, to compare verify schedules and confidence calibrations at the cost of index lookups.

Each round drafts the suffix drafter's greedy chain (up to --max-draft tokens, its shared index seeded as shipped and
the request's own tokens indexed as decoded), a schedule picks how many to verify, and the round accepts the drafts
that match the response (greedy verification) plus the target's own token. Time per round is priced with this
machine's verify-cost profile (the cached one of the tuned 2-thread target, one row) plus a drafting cost per step
and a per-round rest; AR pays the one-token verify plus its own rest per token. D-cut runs the package's own
`ConfidenceCalibrator`, `observed_steps`, `dcut_depths` and `worth_drafting_further`, each schedule from a fresh
calibrator, carried across the requests of a source as in a benchmark run; `dcut_bound` is D-cut with the early exit
it had before (every further step forecast at the last one's confidence), `dcut_step_groups` with a round's second
and third steps calibrated apart from the later ones. (Calibration bins halving 1 − q above 1/2 instead of
tenths, tried with this replay before `ConfidenceCalibrator` computed in plain floats, changed τ and speedup by
under 1 %.) Each D-cut row also prints its reliability: per fifth of the calibrated c_k of a verified step, how often
the prefix up to it was accepted, and how many steps fell there.

    .venv/bin/python benchmarks/issue35/dcut_replay/replay.py [--per-source 24] [--schedules dcut,constant-2,...]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
from collections import defaultdict
from importlib import resources

import torch

from angelspec_hf.generation.dcut import ConfidenceCalibrator, dcut_depths, observed_steps, worth_drafting_further
from angelspec_hf.models.suffix.modeling_suffix import SuffixDrafter


class DepthGroupCalibrator(ConfidenceCalibrator):
    """A round's first, second and third drafted tokens calibrated apart from the later ones."""

    STEP_GROUPS = ("first", "second", "third", "later")


def verify_profile(path: str | None):
    """Seconds of a one-row verify forward by width, interpolated linearly over the cached profile's token counts."""
    if path is None:
        pattern = os.path.expanduser("~/.cache/angelspec_hf/verify_cost/*.json")
        candidates = [json.load(open(p)) for p in glob.glob(pattern) if os.path.getsize(p)]
        candidates = [
            c for c in candidates if c["machine"]["threads"] == 2 and c["machine"]["linear_kernels"] != "default"
        ]
        profile = candidates[0]
    else:
        profile = json.load(open(path))
    tokens, seconds = profile["tokens"], profile["seconds"][0]

    def verify(width: int) -> float:
        for (t0, s0), (t1, s1) in zip(zip(tokens, seconds), zip(tokens[1:], seconds[1:])):
            if t0 <= width <= t1:
                return s0 + (s1 - s0) * (width - t0) / (t1 - t0)
        return seconds[-1]

    return verify


def greedy_chain(drafter, state, max_draft: int) -> list[tuple[int, float]]:
    """The drafter's greedy chain from the row's current text: (token, q(token)) per step, until no match."""
    suffix = state.rows[0].tokens[-drafter.config.max_match_length :]
    found = drafter.end_matches(state, 0)
    chain = []
    for _ in range(max_draft):
        found, match = drafter._bounded_matches(state, 0, suffix, *found)
        if match.length < drafter.config.min_match_length:
            break
        counts = match.counts
        token, count = max(counts.items(), key=lambda item: item[1])
        weight = match.length / (match.length + 1)
        chain.append((token, (1 - weight) / drafter.config.vocab_size + weight * count / sum(counts.values())))
        suffix = (suffix + [token])[-drafter.config.max_match_length :]
        found = [drafter._after(m, token) for m in found]
    return chain


class Schedule:
    """How many of a round's drafts to verify, and how many to draft."""

    def __init__(self, name: str, verify, max_draft: int, draft_ms: tuple[float, float]):
        self.name, self.verify, self.max_draft = name, verify, max_draft
        self.first_ms, self.step_ms = draft_ms
        kind, _, arg = name.partition("-")
        self.kind, self.depth = kind, int(arg) if kind == "constant" else None
        calibrators = {
            "dcut": ConfidenceCalibrator,
            "dcut_bound": ConfidenceCalibrator,
            "dcut_step_groups": DepthGroupCalibrator,
        }
        self.calibrator = calibrators.get(kind, lambda: None)()
        self.bound = kind == "dcut_bound"  # D-cut's early exit before the forecast
        self.reliability = defaultdict(list)  # by fifth of calibrated c_k: whether the prefix up to k was accepted

    def draft_seconds(self, steps: int) -> float:
        return 0.0 if steps == 0 else (self.first_ms + (steps - 1) * self.step_ms) / 1000

    def plan(self, chain: list[tuple[int, float]]) -> tuple[int, int]:
        """(drafted steps, verified drafts) for a round whose greedy chain is `chain`."""
        if self.depth is not None:
            steps = min(self.depth, len(chain))
            return steps, steps
        # c_k reads only the steps up to k, so the whole chain's confidences serve every step's early exit
        calibrated = self.calibrator(torch.tensor([p for _, p in chain], dtype=torch.float64))
        steps = 0
        while steps < len(chain):
            steps += 1
            if not self.worth_more([calibrated[:steps]], steps):
                break
        depth = dcut_depths([calibrated[:steps]], lambda rows, width: self.verify(width), self.draft_seconds(steps))[0]
        return steps, depth

    def worth_more(self, confidences, steps: int) -> bool:
        if not self.bound:
            return worth_drafting_further(
                confidences,
                lambda rows, width: self.verify(width),
                self.max_draft,
                self.draft_seconds(steps),
                self.step_ms / 1000,
            )
        # the early exit before the forecast: every further step at the last step's confidence (a bound)
        c = confidences[0].tolist()
        best = max((1 + sum(c[:w])) / (self.draft_seconds(steps) + self.verify(1 + w)) for w in range(steps + 1))
        for more in range(1, self.max_draft - steps + 1):
            rate = (1 + sum(c) + more * c[-1]) / (self.draft_seconds(steps + more) + self.verify(1 + steps + more))
            if rate > best:
                return True
        return False

    def observe(self, chain, depth: int, accepted: int) -> None:
        if self.calibrator is None or depth == 0:
            return
        q = torch.tensor([[p for _, p in chain[:depth]]], dtype=torch.float64)
        for k, c in enumerate(self.calibrator(q)[0].tolist()):  # reliability: promised c_k against prefix accepted
            self.reliability[min(int(c * 5), 4)].append(float(accepted > k))
        reached, outcomes = observed_steps(depth, accepted)
        self.calibrator.update(
            torch.tensor([p for _, p in chain[:reached]], dtype=torch.float64),
            torch.arange(reached),
            torch.tensor(outcomes),
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", default="model_cards/smollm2-135m-instruct-suffix")
    parser.add_argument("--per-source", type=int, default=24)
    parser.add_argument("--schedules", default="constant-1,constant-2,constant-3,constant-4,dcut_bound,dcut")
    parser.add_argument("--max-draft", type=int, default=8)
    parser.add_argument("--profile", default=None, help="a verify-cost JSON (default: the cached 2-thread one)")
    parser.add_argument("--draft-ms", default="0.45,0.32", help="first drafting step, each later step (ms)")
    parser.add_argument("--rest-ms", default="2.4,1.0", help="a drafting round's rest, an AR step's rest (ms)")
    args = parser.parse_args()
    verify = verify_profile(args.profile)
    draft_ms = tuple(float(x) for x in args.draft_ms.split(","))
    rest_ms, ar_rest_ms = (float(x) / 1000 for x in args.rest_ms.split(","))
    drafter = SuffixDrafter.from_pretrained(args.drafter)
    path = resources.files("angelspec_hf") / "data/smollm2-135m-instruct/heldout_responses.jsonl.gz"
    by_source = defaultdict(list)
    for line in gzip.open(path):
        record = json.loads(line)
        if len(by_source[record["source"]]) < args.per_source:
            by_source[record["source"]].append(record)
    names = args.schedules.split(",")
    print(f"verify ms by width: {[round(verify(w) * 1000, 1) for w in range(1, args.max_draft + 2)]}")
    print("source        schedule         tau   speedup  drafted/round  verified/round")
    for source, records in by_source.items():
        for name in names:
            schedule = Schedule(name, verify, args.max_draft, draft_ms)
            tokens = rounds = drafted = verified = 0
            seconds = 0.0
            for record in records:
                drafter.forget_served_requests()
                state = drafter.new_draft_state(1)
                index = state.rows[0]
                index.extend(record["prompt_ids"])
                response = record["response_ids"]
                t = 0
                while t < len(response):
                    chain = greedy_chain(drafter, state, args.max_draft)
                    steps, depth = schedule.plan(chain) if chain else (0, 0)
                    truth = response[t : t + depth]
                    accepted = 0
                    while accepted < len(truth) and chain[accepted][0] == truth[accepted]:
                        accepted += 1
                    schedule.observe(chain, depth, accepted)
                    seconds += schedule.draft_seconds(steps) + verify(1 + depth) + (rest_ms if steps else ar_rest_ms)
                    emitted = min(accepted + 1, len(response) - t)
                    index.extend(response[t : t + emitted])
                    t += emitted
                    tokens += emitted
                    rounds += 1
                    drafted += steps
                    verified += depth
            ar_seconds = tokens * (verify(1) + ar_rest_ms)
            print(
                f"{source:13s} {name:15s} {tokens / rounds:5.2f}  {ar_seconds / seconds:6.3f}x"
                f"  {drafted / rounds:12.2f}  {verified / rounds:14.2f}  "
                + " ".join(f"c{b}:{sum(v) / len(v):.2f}/{len(v)}" for b, v in sorted(schedule.reliability.items()))
            )


if __name__ == "__main__":
    main()
