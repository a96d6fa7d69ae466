# The batched engine at 4 requests, suffix drafter and router under D-cut, before (e010fda: ĝ a five-round average of
# the rounds' g) and after (ĝ the share of time saved over about 20 rounds), old/new/new/old, from the repository root:
#   bash benchmarks/issue36/dcut_gain/engine_c4/ab.sh
source benchmarks/issue35/ab_bench.sh
ab_old_code e010fda
out=benchmarks/issue36/dcut_gain/engine_c4
args=(--drafter model_cards/smollm2-135m-instruct-suffix --drafter model_cards/smollm2-135m-instruct-router
  --schedules dcut --prompts mixed --concurrency 4 --min-requests 8 --max-new-tokens 48)
ab_bench old $out/old_1 "${args[@]}"
ab_bench new $out/new_1 "${args[@]}"
ab_bench new $out/new_2 "${args[@]}"
ab_bench old $out/old_2 "${args[@]}"
