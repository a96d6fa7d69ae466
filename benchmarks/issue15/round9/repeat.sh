#!/bin/bash
# MT-bench again (the one domain below 0.97x of the suffix member in run_rest.sh), same command, machine idle.
export HF_HUB_OFFLINE=1
M=model_cards/smollm2-135m-instruct
.venv/bin/angelspec bench --prompts mt_bench --data-dir ../shared/data --limit 16 --max-new-tokens 128 \
  --drafter $M-suffix --drafter $M-router --output benchmarks/issue15/round9/mt_bench_repeat.json \
  > benchmarks/issue15/round9/mt_bench_repeat.log 2>&1
# Before round 9's change, each member alone on 8 math-reasoning prompts (math_reasoning_members.json):
# .venv/bin/angelspec bench --prompts spec_bench:math_reasoning --data-dir ../shared/data --limit 8 --max-new-tokens 128 \
#   --drafter $M-suffix --drafter $M-dfly --drafter $M-mtp --drafter $M-router --output .../math_reasoning_members.json
