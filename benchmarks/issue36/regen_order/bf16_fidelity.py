"""How close is the bf16 target to the float32 one on its own responses? Teacher-forced over recorded greedy
responses: top-1 agreement and mean KL(fp32 || bf16) at response positions; and the float32 target's mean
log-likelihood of bf16-sampled vs float32-sampled responses (same prompts, same seeds)."""

import sys

import torch

import angelspec_hf
from angelspec_hf.training.regenerate import read_responses


n = int(sys.argv[1])
recs = read_responses("data/smollm2-135m-instruct/chat_mtbench101_responses.jsonl.gz")[:n]
f32 = angelspec_hf.load_target("smollm2").model
b16 = angelspec_hf.load_target("smollm2", dtype="bfloat16").model
agree = total = 0
kl = 0.0
with torch.no_grad():
    for r in recs:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        p = len(r["prompt_ids"])
        a = f32(input_ids=ids).logits[0, p - 1 : -1].float().log_softmax(-1)
        b = b16(input_ids=ids).logits[0, p - 1 : -1].float().log_softmax(-1)
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += a.shape[0]
        kl += (a.exp() * (a - b)).sum().item()
print(
    f"{len(recs)} responses, {total} positions: top-1 agreement {agree / total:.4f}, mean KL(fp32||bf16) {kl / total:.5f} nats"
)
