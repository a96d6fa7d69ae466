#!/bin/bash
# MTP alone on GSM8K test, the old code and the new twice each (new, old, new, old): is its drop in ab.sh the forecast
# early exit or D-cut's probe timing?
set -e
cd "$(dirname "$0")/../../.."
. benchmarks/issue35/ab_bench.sh
ab_old_code ae1f813  # the old code of ab.sh
out=benchmarks/issue35/forecast_exit
for run in 1 2; do
  for code in new old; do
    ab_bench $code $out/mtp_gsm8k_test_${code}_$run --drafter smollm2-135m-instruct-mtp \
      --prompts gsm8k_test --data-dir ../shared/data --limit 8 --max-new-tokens 128
  done
done
