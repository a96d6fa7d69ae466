# The target states hooked on the tapped layers (new) against transformers' output_hidden_states (old: ab9cadc),
# MTP on 16 MT-bench prompts x 128 tokens, old/new/new/old; run from the repository root.
. benchmarks/issue35/ab_bench.sh
ab_old_code ab9cadc
out=benchmarks/issue36/target_states
args="--drafter model_cards/smollm2-135m-instruct-mtp --prompts mt_bench --limit 16 --max-new-tokens 128"
ab_bench old $out/mtp_old_1 $args
ab_bench new $out/mtp_new_1 $args
ab_bench new $out/mtp_new_2 $args
ab_bench old $out/mtp_old_2 $args
