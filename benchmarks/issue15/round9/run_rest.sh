#!/bin/bash
# The other domains and the engine with the round-9 router (as run.sh: suffix and router only, machine idle), and
# math reasoning again on the final code (run.sh's ran before VerifyCostModel memoised its lookups).
export HF_HUB_OFFLINE=1
out=benchmarks/issue15/round9
M=model_cards/smollm2-135m-instruct
for domain in spec_bench:rag spec_bench:summarization spec_bench:translation mt_bench gsm8k_test spec_bench:math_reasoning; do
  .venv/bin/angelspec bench --prompts $domain --data-dir ../shared/data --limit 16 --max-new-tokens 128 \
    --drafter $M-suffix --drafter $M-router --output $out/${domain#spec_bench:}.json > $out/${domain#spec_bench:}.log 2>&1
done
.venv/bin/angelspec bench --concurrency 1,4,16 --prompts mixed --data-dir ../shared/data --max-new-tokens 32 \
  --min-requests 48 --drafter $M-suffix@dcut --drafter $M-router@dcut --output $out/engine.json > $out/engine.log 2>&1
touch $out/DONE_REST
