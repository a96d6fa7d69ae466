#!/bin/bash
# Round 9: the router's rates now count the measured rest of a round (round_overhead) and each member's delivered
# share of its promised tokens (delivery). The two domains below 0.97x of the suffix member in round 8b, then two
# where it was above; 16 prompts each, suffix and router, machine idle. (MT-bench failed here, named as a Spec-Bench
# category: it is the prompt set mt_bench, run in run_rest.sh.)
export HF_HUB_OFFLINE=1
out=benchmarks/issue15/round9
M=model_cards/smollm2-135m-instruct
for domain in spec_bench:math_reasoning mbpp_test spec_bench:mt_bench spec_bench:qa; do
  .venv/bin/angelspec bench --prompts $domain --data-dir ../shared/data --limit 16 --max-new-tokens 128 \
    --drafter $M-suffix --drafter $M-router --output $out/${domain#spec_bench:}.json > $out/${domain#spec_bench:}.log 2>&1
done
touch $out/DONE
