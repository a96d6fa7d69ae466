"""The router against its suffix member on the suite's eight domains (`domain_prompts(16)`: 16 prompts each, 128 new
tokens, greedy, D-cut, AR and both drafters in one process prompt by prompt), with the target states hooked on the
tapped layers: issue 36's router target on the median. Writes the per-domain reports and the summary as JSON.

    .venv/bin/python benchmarks/issue36/target_states/router_vs_suffix.py OUTPUT.json
"""

import json
import sys

from angelspec_hf import load_target
from angelspec_hf.benchmark.bench import drafter_methods, run_benchmark
from angelspec_hf.benchmark.suite import domain_prompts, summarize_domains
from angelspec_hf.hub import load_drafter


target = load_target("smollm2")
names = ["smollm2-135m-instruct-router", "smollm2-135m-instruct-suffix"]
methods = [m for name in names for m in drafter_methods(name, load_drafter(name, target.model, target.tokenizer))]
domains = {}
for i, (domain, prompts) in enumerate(domain_prompts(16, "../shared/data").items()):
    domains[domain] = run_benchmark(target.model, target.tokenizer, methods, prompts, 128, warm_up=i == 0)
    line = {m["name"].split(":")[0]: f"{m['speedup']:.2f}x ({m['tau']:.2f})" for m in domains[domain]["methods"]}
    print(domain, line, flush=True)
summary = summarize_domains(domains)
print(json.dumps(summary, indent=1))
with open(sys.argv[1], "w") as handle:
    json.dump({"domains": domains, "summary": summary}, handle, indent=1)
