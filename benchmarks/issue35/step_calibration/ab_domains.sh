#!/bin/bash
# The suite's other Spec-Bench domains, 8 prompts each: the suffix and MTP drafters under D-cut, old code (a2bfa29,
# worktree /tmp/wt_old) and new back to back, alternating which runs first, as ab.sh.
set -e
cd "$(dirname "$0")/../../.."
. benchmarks/issue35/ab_bench.sh
[ -d /tmp/wt_old ] || git worktree add /tmp/wt_old a2bfa29
out=benchmarks/issue35/step_calibration
first=old
for domain in translation summarization qa math_reasoning rag; do
  order="old new"; [ $first = new ] && order="new old"
  for code in $order; do
    ab_bench $code $out/${domain}_${code} \
      --drafter smollm2-135m-instruct-suffix --drafter smollm2-135m-instruct-mtp \
      --prompts spec_bench:$domain --data-dir ../shared/data --limit 8 --max-new-tokens 128
  done
  [ $first = old ] && first=new || first=old
done
