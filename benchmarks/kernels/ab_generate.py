"""A/B in one process: plain greedy generate() of SmolLM2 with the tuned linear-kernel plan and with PyTorch's default
kernels, taking turns per MT-bench prompt (argument: how many prompts). Run from the repository root."""

import sys
import time

import torch

import angelspec_hf
from angelspec_hf.generation.kernels import tune_linear_kernels, untune_linear_kernels
from angelspec_hf.prompts import encode_chat, load_prompts


target = angelspec_hf.load_target("smollm2")
rows = load_prompts("mt_bench", data_dir="../shared/data", limit=int(sys.argv[1]) if len(sys.argv) > 1 else 8)
seconds, tokens, identical = {"tuned": 0.0, "default": 0.0}, {"tuned": 0, "default": 0}, 0
for i, row in enumerate(rows):
    input_ids = torch.tensor([encode_chat(target.tokenizer, row["prompt"])])
    outputs = {}
    for mode in ["tuned", "default"] if i % 2 == 0 else ["default", "tuned"]:
        (tune_linear_kernels if mode == "tuned" else untune_linear_kernels)(target.model)
        start = time.perf_counter()
        outputs[mode] = target.model.generate(input_ids, max_new_tokens=128, do_sample=False)
        seconds[mode] += time.perf_counter() - start
        tokens[mode] += outputs[mode].shape[1] - input_ids.shape[1]
    identical += torch.equal(outputs["tuned"], outputs["default"])
rates = {mode: round(tokens[mode] / seconds[mode], 2) for mode in seconds}
print(f"tokens/s {rates}, tuned/default {rates['tuned'] / rates['default']:.2f}x, identical {identical}/{len(rows)}")
