"""The suffix drafter, the shipped router and routers over subsets of its members (each with its own fresh members,
so no shared suffix index sees another method's outputs), on one domain. Arguments: domain, prompts, subsets such as
mtp+suffix dfly+suffix suffix."""

import sys

import angelspec_hf
from angelspec_hf.benchmark.bench import drafter_methods, format_table, run_benchmark
from angelspec_hf.hub import load_drafter
from angelspec_hf.models.router.modeling_router import RouterDrafter
from angelspec_hf.prompts import load_prompts


domain, limit = sys.argv[1], int(sys.argv[2])
target = angelspec_hf.load_target("smollm2")
M = "model_cards/smollm2-135m-instruct"
methods = drafter_methods("suffix", load_drafter(M + "-suffix", target.model, target.tokenizer))
full = load_drafter(M + "-router", target.model, target.tokenizer)
methods += drafter_methods("router", full)
names = dict(zip(full.member_names, full.members))
for combo in sys.argv[3:]:
    keep = combo.split("+")
    fresh = [load_drafter(f"{M}-router/members/{k}", target.model, target.tokenizer) for k in keep]
    r = RouterDrafter.from_members(fresh, names=keep).bind_target(target.model, target.tokenizer)
    r.generation_config = full.generation_config
    methods += drafter_methods("router-" + combo, r)
prompts = [r["prompt"] for r in load_prompts(domain, data_dir="../shared/data", limit=limit)]
res = run_benchmark(target.model, target.tokenizer, methods, prompts, 128)
print(format_table(res))
