#!/bin/bash
# After round 8: a router member's D-cut early exit weighs no steps beyond the member's own cap. The three domains
# where the router trailed its suffix member most in round 8, 16 prompts each, suffix and router only, machine idle.
export HF_HUB_OFFLINE=1
out=benchmarks/issue15/round8b
M=model_cards/smollm2-135m-instruct
for domain in spec_bench:math_reasoning gsm8k_test spec_bench:qa; do
  .venv/bin/angelspec bench --prompts $domain --data-dir ../shared/data --limit 16 --max-new-tokens 128 \
    --drafter $M-suffix --drafter $M-router --output $out/${domain#spec_bench:}.json > $out/${domain#spec_bench:}.log 2>&1
done
touch $out/DONE
