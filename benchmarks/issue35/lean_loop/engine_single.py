"""Does one sequence decode faster on the package's engine loop than on transformers' `_assisted_decoding`? Each
drafter runs both ways in one `run_benchmark` (AR first, same prompts, default threads), each with a drafter of its
own: `generate(assistant_model=)`, which now hands a plain call to the engine (`speculative.runs_on_engine`), and a
`custom_generate` that runs transformers' loop (with `AngelSpecCandidateGenerator`) as before. (The measurement in
engine_single.txt predates the routing: then `generate` was transformers' loop and a `custom_generate` the engine.)

    .venv/bin/python benchmarks/issue35/lean_loop/engine_single.py gsm8k_test 8 --drafters suffix,mtp
"""

import argparse

import angelspec_hf
from angelspec_hf.benchmark.bench import Method, format_table, run_benchmark
from angelspec_hf.benchmark.suite import domain_or_set_prompts
from angelspec_hf.generation import speculative
from angelspec_hf.generation.policies import resolve_policy
from angelspec_hf.hub import load_drafter


def on_transformers_loop(
    model, input_ids, logits_processor, stopping_criteria, generation_config, drafter=None, **model_kwargs
):
    return speculative._ORIGINAL_ASSISTED_DECODING(
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        assistant_model=drafter,
        **model_kwargs,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("prompts", nargs="?", default="gsm8k_test")
    parser.add_argument("limit", nargs="?", type=int, default=8)
    parser.add_argument("--drafters", default="suffix")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--data-dir", default="../shared/data")
    args = parser.parse_args()
    target = angelspec_hf.load_target("smollm2")
    model, tokenizer = target.model, target.tokenizer
    prompts = domain_or_set_prompts(args.prompts, args.limit, args.data_dir)
    methods = []
    for short in args.drafters.split(","):
        name = f"smollm2-135m-instruct-{short}"
        transformers_loop, engine_loop = (load_drafter(name, model, tokenizer) for _ in range(2))
        methods.append(
            Method(
                f"{short}:transformers-loop",
                {"custom_generate": on_transformers_loop, "drafter": transformers_loop},
                transformers_loop,
                resolve_policy("dcut", transformers_loop),
            )
        )
        methods.append(
            Method(
                f"{short}:generate", {"assistant_model": engine_loop}, engine_loop, resolve_policy("dcut", engine_loop)
            )
        )
    results = run_benchmark(model, tokenizer, methods, prompts, args.max_new_tokens)
    print(f"{args.prompts}, {len(prompts)} prompts x {args.max_new_tokens} tokens")
    print(format_table(results))


if __name__ == "__main__":
    main()
