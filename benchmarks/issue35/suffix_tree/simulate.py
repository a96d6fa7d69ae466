"""Offline: would verifying a tree of suffix drafts instead of one chain raise the tokens accepted per round enough to
pay for the wider verify forward? Replays the target's greedy held-out responses position by position with the shipped
suffix drafter (its shared index, then the request's own tokens indexed as they are decoded) and, at every position,
counts the tokens a chain of the B most likely drafts and a best-first tree of B nodes would have had accepted.

    .venv/bin/python benchmarks/issue35/suffix_tree/simulate.py [--budgets 1,2,3,4,6,8] [--per-source 24]
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
from collections import defaultdict
from importlib import resources

from angelspec_hf.models.suffix.modeling_suffix import SuffixDrafter


def children(drafter, state, suffix, found):
    """(token, q(token), next suffix, next found) for each token some occurrence continued with, most likely first."""
    found, match = drafter._bounded_matches(state, 0, suffix, *found)
    if match.length < drafter.config.min_match_length:
        return []
    counts = match.counts
    total = sum(counts.values())
    weight = match.length / (match.length + 1)
    floor = (1 - weight) / drafter.config.vocab_size
    out = []
    for token, count in sorted(counts.items(), key=lambda item: -item[1]):
        nxt = (suffix + [token])[-drafter.config.max_match_length :]
        out.append((token, floor + weight * count / total, nxt, [drafter._after(m, token) for m in found]))
    return out


def best_first(drafter, state, suffix, budget, chain):
    """Up to `budget` drafted nodes by path probability: (path tokens, path probability) per node."""
    heap = [(-1.0, 0, [], suffix, drafter.end_matches(state, 0))]
    nodes, tie = [], 1
    while heap and len(nodes) < budget:
        negative, _, path, sfx, found = heapq.heappop(heap)
        if path:
            nodes.append((tuple(path), -negative))
        for rank, (token, q, nxt, nfound) in enumerate(children(drafter, state, sfx, found)):
            if chain and rank:
                break
            heapq.heappush(heap, (negative * q, tie, path + [token], nxt, nfound))
            tie += 1
    return nodes


def accepted(nodes, truth):
    drafted = {path for path, _ in nodes}
    n = 0
    while n < len(truth) and tuple(truth[: n + 1]) in drafted:
        n += 1
    return n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", default="model_cards/smollm2-135m-instruct-suffix")
    parser.add_argument("--budgets", default="1,2,3,4,6,8,12")
    parser.add_argument("--per-source", type=int, default=24)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    drafter = SuffixDrafter.from_pretrained(args.drafter)
    path = resources.files("angelspec_hf") / "data/smollm2-135m-instruct/heldout_responses.jsonl.gz"
    records = [json.loads(line) for line in gzip.open(path)]
    taken = defaultdict(int)
    sums = defaultdict(lambda: defaultdict(float))  # per source: tokens, and rounds per shape and budget
    for record in records:
        source = record["source"]
        if taken[source] >= args.per_source:
            continue
        taken[source] += 1
        state = drafter.new_draft_state(1)
        index = state.rows[0]
        index.extend(record["prompt_ids"])
        response = record["response_ids"]
        at_position = []  # what a round starting there would have accepted, per shape and budget
        for t in range(len(response)):
            suffix = index.tokens[-drafter.config.max_match_length :]
            truth = response[t : t + max(budgets)]
            row = {}
            for shape in ("chain", "tree"):
                nodes = best_first(drafter, state, list(suffix), max(budgets), shape == "chain")
                for budget in budgets:
                    row[f"{shape}{budget}"] = accepted(nodes[:budget], truth)
            at_position.append(row)
            index.extend([response[t]])
        sums[source]["tokens"] += len(response)
        for key in at_position[0] if at_position else ():
            t = 0
            while t < len(response):  # a round: its accepted drafts and the target's own token
                t += at_position[t][key] + 1
                sums[source][key] += 1
    print("tau: tokens per round when every round verifies B drafted tokens (a chain or a best-first tree)")
    header = "source       " + "".join(f"  chain{b:<3d} tree{b:<3d}" for b in budgets)
    print(header)
    for source, row in sums.items():
        n = row["tokens"]
        print(f"{source:12s} " + "".join(f"  {n / row[f'chain{b}']:8.3f} {n / row[f'tree{b}']:7.3f}" for b in budgets))


if __name__ == "__main__":
    main()
