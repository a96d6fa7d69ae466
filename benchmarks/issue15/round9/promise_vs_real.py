"""Per kind of router round (member, suffix outlook bucket, try): the tokens per second the router promised when
choosing it against what the round gave in wall time, and the round's seconds beyond drafting and the profiled verify
forward. Arguments: domain, number of prompts[, router folder]. Used to find round_overhead and delivery."""

import collections
import sys
import time

import torch

import angelspec_hf
from angelspec_hf.hub import load_drafter
from angelspec_hf.models.router.modeling_router import RouterDrafter
from angelspec_hf.prompts import encode_chat, load_prompts


domain, limit = sys.argv[1], int(sys.argv[2])
target = angelspec_hf.load_target("smollm2")
router = load_drafter(
    sys.argv[3] if len(sys.argv) > 3 else "model_cards/smollm2-135m-instruct-router", target.model, target.tokenizer
)
ps = [
    torch.tensor([encode_chat(target.tokenizer, r["prompt"])])
    for r in load_prompts(domain, data_dir="../shared/data", limit=limit)
]
stat = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])  # rounds, seconds, tokens, predicted rate sum, verified
last = {"t": None}
orig_rec = RouterDrafter.record_acceptance


def rec(self, state, drafted, accepted):
    now = time.perf_counter()
    row = state.rows[0]
    if last["t"] is not None and row.last_member is not None:
        k = (
            self.member_names[row.last_member],
            row.last_bucket if row.last_bucket is None else min(row.last_bucket, 4),
            row.last_try,
        )
        resid = now - last["t"] - last.get("prop", 0) - self.verify_cost_model(1, 1 + drafted[0])
        res[k][0] += last.get("prop", 0)
        res[k][1] += resid
        s = stat[k]
        s[0] += 1
        s[1] += now - last["t"]
        s[2] += 1 + accepted[0]
        s[3] += last.get("pred", 0)
        s[4] += drafted[0]
    out = orig_rec(self, state, drafted, accepted)
    last["t"] = time.perf_counter()
    return out


RouterDrafter.record_acceptance = rec
res = collections.defaultdict(lambda: [0.0, 0.0])
orig_prop = RouterDrafter.propose


def prop(self, *a, **k):
    t = time.perf_counter()
    out = orig_prop(self, *a, **k)
    last["prop"] = time.perf_counter() - t
    return out


RouterDrafter.propose = prop
orig_choice = RouterDrafter.choice


def choice(self, state, r, pending=()):
    out = orig_choice(self, state, r, pending)
    row = state.rows[r]
    last["pred"] = self.score(row, out[0], out[1], len(pending), 1)
    return out


RouterDrafter.choice = choice
for i, p in enumerate(ps):
    last["t"] = None
    target.model.generate(p, assistant_model=router, max_new_tokens=128, do_sample=False)
print("member bucket try | rounds  real tok/s  predicted tok/s  tokens/round verified/round")
for k in sorted(stat, key=str):
    s = stat[k]
    print(k, s[0], round(s[2] / s[1], 1), round(s[3] / s[0], 1), round(s[2] / s[0], 2), round(s[4] / s[0], 2))
for k in sorted(res, key=str):
    print(
        k,
        "propose ms",
        round(1000 * res[k][0] / stat[k][0], 1),
        "residual ms",
        round(1000 * res[k][1] / stat[k][0], 1),
    )
print(
    "plain",
    router._rate(0.0, {0: 1.0}, 0.0, 1),
    router.member_seconds,
    "overhead",
    router.round_overhead,
    "delivery",
    [router.delivery(m) for m in range(3)],
    router.member_promised,
    router.member_delivered,
)
