#!/bin/bash
# Before/after D-cut's forecast early exit (each row's further drafting steps forecast at its last step's calibrated
# rate instead of at its last confidence), old and new code alternating on the same idle machine, default threads:
# the old code (ae1f813, a git worktree at /tmp/wt_old) with its own measurement cache (both seeded with
# the same kernel plan and verify profile). One schedule (dcut) per drafter.
set -e
cd "$(dirname "$0")/../../.."
. benchmarks/issue35/ab_bench.sh
ab_old_code ae1f813
ab_pairs benchmarks/issue35/forecast_exit "gsm8k_test mt_bench mbpp_test" \
  --drafter smollm2-135m-instruct-suffix --drafter smollm2-135m-instruct-mtp --drafter smollm2-135m-instruct-dfly \
  --data-dir ../shared/data --limit 8 --max-new-tokens 128
