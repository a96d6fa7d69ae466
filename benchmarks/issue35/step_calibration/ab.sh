#!/bin/bash
# Before/after D-cut's per-step calibration (the confidence of a prefix is the product of its steps' calibrated
# conditional acceptance, a round's first step calibrated apart), old and new code back to back on the same idle
# machine, default threads: the old code (a2bfa29, a git worktree at /tmp/wt_old) with its own measurement cache
# (both seeded with the same kernel plan and verify profile). One schedule (dcut) per drafter.
set -e
cd "$(dirname "$0")/../../.."
. benchmarks/issue35/ab_bench.sh
ab_old_code a2bfa29
ab_pairs benchmarks/issue35/step_calibration "gsm8k_test mt_bench" \
  --drafter smollm2-135m-instruct-suffix --drafter smollm2-135m-instruct-mtp --drafter smollm2-135m-instruct-dfly \
  --data-dir ../shared/data --limit 8 --max-new-tokens 128
