#!/bin/bash
# The suite's other Spec-Bench domains, 8 prompts each: the suffix and MTP drafters under D-cut, old code (a2bfa29,
# worktree /tmp/wt_old) and new back to back, alternating which runs first, as ab.sh.
set -e
cd "$(dirname "$0")/../../.."
. benchmarks/issue35/ab_bench.sh
ab_old_code a2bfa29
ab_pairs benchmarks/issue35/step_calibration \
  "spec_bench:translation spec_bench:summarization spec_bench:qa spec_bench:math_reasoning spec_bench:rag" \
  --drafter smollm2-135m-instruct-suffix --drafter smollm2-135m-instruct-mtp \
  --data-dir ../shared/data --limit 8 --max-new-tokens 128
