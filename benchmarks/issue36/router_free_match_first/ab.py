"""The router with and without `free_match_first` (the suffix member drafts every round where its match is at least
2 tokens), beside the suffix member alone, in one `run_benchmark` (AR first, prompt by prompt, default threads):

    .venv/bin/python benchmarks/issue36/router_free_match_first/ab.py gsm8k_test 8

(The table in docs/experiments.md was measured before the option existed, with the same rule patched into
`RoutingPolicy.choice`: the router then had it off.)
"""

import sys

import angelspec_hf
from angelspec_hf.benchmark.bench import Method, format_table, run_benchmark
from angelspec_hf.benchmark.suite import domain_or_set_prompts
from angelspec_hf.generation.policies import resolve_policy
from angelspec_hf.hub import load_drafter


domain, limit = sys.argv[1], int(sys.argv[2])
target = angelspec_hf.load_target("smollm2")
model, tokenizer = target.model, target.tokenizer
prompts = domain_or_set_prompts(domain, limit, "../shared/data")
suffix = load_drafter("smollm2-135m-instruct-suffix", model, tokenizer)
methods = [Method("suffix", {"assistant_model": suffix}, suffix, resolve_policy("dcut", suffix))]
for first in (0, 2):
    router = load_drafter("smollm2-135m-instruct-router", model, tokenizer)
    router.config.free_match_first = first
    methods.append(
        Method(
            f"router[free_match_first={first}]", {"assistant_model": router}, router, resolve_policy("dcut", router)
        )
    )
results = run_benchmark(model, tokenizer, methods, prompts, 128)
print(domain, len(prompts), "prompts x 128 tokens")
print(format_table(results))
