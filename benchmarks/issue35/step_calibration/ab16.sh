#!/bin/bash
# MT-bench, 16 prompts: the shipped MTP drafter (at break-even there, where D-cut's probe rounds decide) and the
# suffix drafter, old code (a2bfa29, worktree /tmp/wt_old) then new, as ab.sh.
set -e
cd "$(dirname "$0")/../../.."
[ -d /tmp/wt_old ] || git worktree add /tmp/wt_old a2bfa29
out=benchmarks/issue35/step_calibration
for code in old new; do
  if [ $code = old ]; then path=/tmp/wt_old; cache=/tmp/cache_ab_old; else path=.; cache=/tmp/cache_ab_new; fi
  ANGELSPEC_CACHE=$cache PYTHONPATH=$path .venv/bin/python -m angelspec_hf.cli bench \
    --drafter smollm2-135m-instruct-mtp --drafter smollm2-135m-instruct-suffix \
    --prompts mt_bench --data-dir ../shared/data --limit 16 --max-new-tokens 128 \
    --output $out/mt_bench16_${code}.json > $out/mt_bench16_${code}.log 2>&1
done
