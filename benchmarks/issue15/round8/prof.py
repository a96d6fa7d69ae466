"""cProfile of greedy generate() with one shipped drafter (argument: suffix or router) on 4 Spec-Bench QA prompts,
128 new tokens; prints the cumulative profile and who calls the suffix member's propose and D-cut's choose."""

import cProfile
import pstats

import torch

import angelspec_hf
from angelspec_hf.hub import load_drafter
from angelspec_hf.prompts import encode_chat, load_prompts


target = angelspec_hf.load_target("smollm2")
router = load_drafter("model_cards/smollm2-135m-instruct-" + __import__("sys").argv[1], target.model, target.tokenizer)
ps = [
    torch.tensor([encode_chat(target.tokenizer, r["prompt"])])
    for r in load_prompts("spec_bench:qa", data_dir="../shared/data", limit=4)
]
target.model.generate(ps[0], assistant_model=router, max_new_tokens=8, do_sample=False)
pr = cProfile.Profile()
pr.enable()
for p in ps:
    target.model.generate(p, assistant_model=router, max_new_tokens=128, do_sample=False)
pr.disable()
st = pstats.Stats(pr)
st.sort_stats("cumulative").print_stats(45)
st.print_callers("modeling_suffix.py:516")
st.print_callees("modeling_suffix.py:516")
st.print_callers("dcut.py:404")
