#!/bin/bash
# The engine loop against transformers' loop for one sequence on the suite's other six domains (engine_single.py:
# both in one run per domain, prompt by prompt, AR first), idle, default threads, 8 prompts x 128 tokens each.
set -e
cd "$(dirname "$0")/../../.."
for domain in translation summarization qa math_reasoning rag mbpp_test; do
  .venv/bin/python benchmarks/issue35/lean_loop/engine_single.py $domain 8 --drafters suffix,mtp,dfly \
    > runs/engine_single_$domain.log 2>&1
done
