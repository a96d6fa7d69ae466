"""Where the router's time beyond its suffix member goes: seconds inside each member's propose (tries' catch-ups
included), rounds per member, on one domain, suffix and router interleaved per prompt."""

import sys
import time
from collections import Counter, defaultdict

import angelspec_hf
from angelspec_hf.benchmark.bench import drafter_methods, format_table, run_benchmark
from angelspec_hf.hub import load_drafter
from angelspec_hf.models.router.modeling_router import RouterDrafter
from angelspec_hf.prompts import load_prompts


domain, limit = sys.argv[1], int(sys.argv[2])
target = angelspec_hf.load_target("smollm2")
M = "model_cards/smollm2-135m-instruct"
suffix = load_drafter(M + "-suffix", target.model, target.tokenizer)
router = load_drafter(M + "-router", target.model, target.tokenizer)
rounds, seconds, tries, read = Counter(), defaultdict(float), Counter(), Counter()
original = RouterDrafter._draft_with


def timed(self, m, state, rows, num_tokens, *a):
    name = self.member_names[m]
    start = time.perf_counter()
    out = original(self, m, state, rows, num_tokens, *a)
    if name != "suffix":
        seconds[name] += time.perf_counter() - start
        rounds[name] += len(rows)
    return out


RouterDrafter._draft_with = timed
orig_choice = RouterDrafter.choice


def choice(self, state, r, pending=()):
    out = orig_choice(self, state, r, pending)
    if out[2]:
        tries[self.member_names[out[0]]] += 1
        read[self.member_names[out[0]]] += len(state.rows[r].members[out[0]].tokens) + len(pending)
    return out


RouterDrafter.choice = choice
prompts = [r["prompt"] for r in load_prompts(domain, data_dir="../shared/data", limit=limit)]
res = run_benchmark(
    target.model, target.tokenizer, drafter_methods("suffix", suffix) + drafter_methods("router", router), prompts, 128
)
print(format_table(res))
for m in res["methods"]:
    print(
        m["name"],
        round(m["seconds"], 2),
        m["target_forwards"],
        {k: round(v * m["seconds"], 2) for k, v in m["time_split"].items()},
    )
print("neural member rounds", dict(rounds), "seconds in their propose", {k: round(v, 2) for k, v in seconds.items()})
print("choices flagged as tries (counted per choice call)", dict(tries), "tokens waiting then", dict(read))
