#!/bin/bash
# MT-bench, 16 prompts: the shipped MTP drafter (at break-even there, where D-cut's probe rounds decide) and the
# suffix drafter, old code (a2bfa29, worktree /tmp/wt_old) then new, as ab.sh.
set -e
cd "$(dirname "$0")/../../.."
. benchmarks/issue35/ab_bench.sh
ab_old_code a2bfa29
out=benchmarks/issue35/step_calibration
for code in old new; do
  ab_bench $code $out/mt_bench16_${code} \
    --drafter smollm2-135m-instruct-mtp --drafter smollm2-135m-instruct-suffix \
    --prompts mt_bench --data-dir ../shared/data --limit 16 --max-new-tokens 128
done
