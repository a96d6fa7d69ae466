#!/bin/bash
# After the interleaved measurement and drafters following the plan: plan and profile again, the same-process A/B,
# MT-bench with MTP (D-cut and constant-1) and suffix, and the demo. Run from the repository root, machine idle.
export HF_HUB_OFFLINE=1
out=benchmarks/kernels
B=".venv/bin/angelspec"
M=model_cards/smollm2-135m-instruct
$B profile --rows 1 > $out/profile2_tuned.log 2>&1
.venv/bin/python $out/ab_generate.py 8 > $out/ab_generate.log 2>&1
$B bench --prompts mt_bench --data-dir ../shared/data --limit 16 --max-new-tokens 128 \
  --drafter $M-mtp@dcut,constant-1 --drafter $M-suffix \
  --output $out/mt_bench_tuned2.json > $out/mt_bench_tuned2.log 2>&1
$B demo > $out/demo.log 2>&1
