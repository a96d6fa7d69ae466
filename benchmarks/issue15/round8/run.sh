#!/bin/bash
# Round 8 of the issue-15 suite: 16 prompts per domain (round 7: 8), the machine idle, default threads, fp32, greedy,
# 128 new tokens; then the engine. Run from the repository root.
export HF_HUB_OFFLINE=1
out=benchmarks/issue15/round8
M=model_cards/smollm2-135m-instruct
for domain in spec_bench:rag spec_bench:summarization spec_bench:translation spec_bench:qa spec_bench:math_reasoning \
    mt_bench gsm8k_test mbpp_test; do
  .venv/bin/angelspec bench --prompts $domain --data-dir ../shared/data --limit 16 --max-new-tokens 128 \
    --prompt-lookup 3 --drafter $M-suffix --drafter $M-router --output $out/${domain#spec_bench:}.json > $out/${domain#spec_bench:}.log 2>&1
done
.venv/bin/angelspec bench --concurrency 1,4,16 --prompts mixed --data-dir ../shared/data --max-new-tokens 32 \
  --min-requests 48 --drafter $M-suffix@dcut --drafter $M-router@dcut --output $out/engine.json > $out/engine.log 2>&1
touch $out/DONE
