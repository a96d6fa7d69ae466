#!/bin/bash
# Before/after the MKL packed GEMM kernel (commit 41cba48), old and new code back to back on the same idle machine,
# default threads: the old code (da8ac1c, a git worktree at /tmp/wt_old) with its own measurement cache, so each
# code measures its own kernel plan and verify profile.
set -e
cd "$(dirname "$0")/../../.."
. benchmarks/issue35/ab_bench.sh
ab_old_code da8ac1c
out=benchmarks/issue35/packed_gemm
for prompts in gsm8k_test mt_bench; do
  order="old new"; [ $prompts = mt_bench ] && order="new old"  # each code first once
  for code in $order; do
    ab_bench $code $out/${prompts}_${code} \
      --drafter smollm2-135m-instruct-suffix --drafter smollm2-135m-instruct-mtp \
      --prompts $prompts --data-dir ../shared/data --limit 8 --max-new-tokens 128
  done
done
