#!/bin/bash
# Linear-kernel plan: profile, then MT-bench and GSM8K with tuned and default kernels (training SIGSTOPped).
cd /work/main
export HF_HUB_OFFLINE=1
out=benchmarks/kernels
B=".venv/bin/angelspec"
M=model_cards/smollm2-135m-instruct
$B profile --rows 1,2,4,8,16 > $out/profile_tuned.log 2>&1
$B profile --rows 1 --linear-kernels default > $out/profile_default.log 2>&1
$B bench --prompts mt_bench --data-dir ../shared/data --limit 16 --max-new-tokens 128 \
  --drafter $M-mtp@dcut,constant-1,constant-3 --drafter $M-suffix --drafter $M-router \
  --output $out/mt_bench_tuned.json > $out/mt_bench_tuned.log 2>&1
$B bench --prompts mt_bench --data-dir ../shared/data --limit 16 --max-new-tokens 128 --linear-kernels default \
  --drafter $M-mtp@dcut,constant-3 --drafter $M-suffix \
  --output $out/mt_bench_default.json > $out/mt_bench_default.log 2>&1
$B bench --prompts gsm8k_test --data-dir ../shared/data --limit 16 --max-new-tokens 128 \
  --drafter $M-dfly --drafter $M-suffix --drafter $M-router \
  --output $out/gsm8k_test_tuned.json > $out/gsm8k_test_tuned.log 2>&1
