"""`angelspec` command line: `demo`, `regenerate` training responses, `estimate` a drafter's acceptance offline,
`bench` drafters against plain decoding (one sequence at a time, or batched with `--concurrency`), `batch` serves a
prompt set through the batched engine, `profile` this machine's linear-kernel plan and the verify cost D-cut plans
with."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from . import __version__
from .arguments import (
    TARGET_DTYPES,
    add_bench_arguments,
    add_suite_arguments,
    add_target_arguments,
    load_target_from_args,
    policy,
    positive_int,
    positive_int_list,
    temperature,
)
from .prompts import check_prompt_source


class UsageError(ValueError):
    """A mistake in the command line or in the files it names: reported in one line, exit status 2."""


def _regenerate(args: argparse.Namespace) -> None:
    from .generation.policies import profiled_rows
    from .generation.verify_cost import load_cost_model
    from .training.regenerate import regenerate_responses

    target = load_target_from_args(args)
    records = regenerate_responses(
        target.model,
        target.tokenizer,
        args.sources.split(","),
        args.output,
        data_dir=args.data_dir,
        limit_per_source=args.limit_per_source,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        seed=args.seed,
        exclude=args.exclude.split(",") if args.exclude else (),
    )
    print(f"{len(records)} responses in {args.output}")
    bound = args.batch_size / load_cost_model(target.model, rows=profiled_rows(args.batch_size))(args.batch_size, 1)
    print(f"the bound of batched decoding on this machine ({args.batch_size} rows per forward): {bound:.0f} tokens/s")


def _teacher_forced(args: argparse.Namespace) -> None:
    import sysconfig

    from .targets import load_target_tokenizer
    from .training.regenerate import teacher_forced_responses

    python_source = sysconfig.get_paths()["stdlib"] if args.python_source == "stdlib" else args.python_source
    records = teacher_forced_responses(
        load_target_tokenizer(args.target),
        [s for s in args.sources.split(",") if s],
        args.output,
        data_dir=args.data_dir,
        limit_per_source=args.limit_per_source,
        max_prompt_tokens=args.max_prompt_tokens,
        max_response_tokens=args.max_response_tokens,
        python_source=python_source,
        chunk_tokens=args.chunk_tokens,
    )
    tokens = sum(len(record["response_ids"]) for record in records)
    print(f"{len(records)} teacher-forced responses, {tokens} response tokens, in {args.output}")


DEFAULT_DRAFTER = "smollm2-135m-instruct-suffix"  # a shipped card (the fastest on MT-bench): load_drafter finds it


def _demo(args: argparse.Namespace) -> None:
    import torch

    from .benchmark.bench import drafter_methods, format_table, run_benchmark
    from .hub import load_drafter
    from .prompts import encode_chat, load_prompts

    target = load_target_from_args(args)
    drafter = load_drafter(args.drafter, target.model, target.tokenizer)
    prompts = [row["prompt"] for row in load_prompts("mt_bench", limit=args.limit)]  # shipped with the package
    results = run_benchmark(
        target.model, target.tokenizer, drafter_methods("drafter", drafter), prompts, args.max_new_tokens
    )
    input_ids = torch.tensor([encode_chat(target.tokenizer, prompts[0])])
    sample = target.model.generate(
        input_ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False
    )
    print(
        f"\nPrompt: {prompts[0]}\nSmolLM2 + {drafter.config.drafter_kind} drafter: {target.tokenizer.decode(sample[0, input_ids.shape[1] :], skip_special_tokens=True)}\n"
    )
    print(format_table(results))
    speculative = results["methods"][1]
    print(
        f"\nτ = {speculative['tau']:.2f} tokens per target forward; speedup {speculative['speedup']:.2f}x over plain "
        f"decoding ({speculative['tokens_per_s']:.1f} vs {results['methods'][0]['tokens_per_s']:.1f} tokens/s); "
        f"outputs identical on {speculative['identical_fraction']:.0%} of {len(prompts)} prompts."
    )


def _bench(args: argparse.Namespace) -> None:
    from .benchmark.bench import main as bench_main

    bench_main(args)


def _suite(args: argparse.Namespace) -> None:
    from .benchmark.suite import main as suite_main

    suite_main(args)


def _profile(args: argparse.Namespace) -> None:
    from .generation.kernels import tune_linear_kernels
    from .generation.verify_cost import cost_model_path, profile_verify_cost
    from .targets import load_target

    # loaded plain, then the kernel plan measured once (first: the verify cost is the tuned model's)
    target = load_target(args.target, dtype=args.dtype, device=args.device, tune_kernels=False)
    if args.linear_kernels == "tuned":
        plan = tune_linear_kernels(target.model, measure=True)
        if plan is not None:
            print(
                "linear kernels (rows: kernel at rows): "
                + (
                    ", ".join(f"{rows}: {name} at {padded}" for rows, (name, padded) in sorted(plan.choices.items()))
                    or "PyTorch's default everywhere"
                )
            )
    rows = sorted({int(r) for r in args.rows.split(",")})
    model = profile_verify_cost(target.model, rows=rows, repeats=args.repeats)
    path = args.output or cost_model_path(target.model)
    model.save(path)
    print(f"verify-cost profile ({model.machine['threads']} threads) -> {path}")
    print("rows \\ tokens " + " ".join(f"{t:>7}" for t in model.tokens))
    for batch, line in zip(model.rows, model.seconds):
        print(f"{batch:>13} " + " ".join(f"{1000 * s:>5.0f}ms" for s in line))


def _batch(args: argparse.Namespace) -> None:
    import json

    from .generation.engine import Request, SpeculativeEngine
    from .hub import load_drafter
    from .prompts import encode_chat, load_prompts

    target = load_target_from_args(args)
    drafter = None
    if args.drafter:
        drafter = load_drafter(args.drafter, target.model, target.tokenizer)
    rows = load_prompts(args.prompts, data_dir=args.data_dir, limit=args.limit)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {}
    requests = [
        Request(
            encode_chat(target.tokenizer, row["prompt"]),
            max_new_tokens=args.max_new_tokens,
            seed=args.seed + i,
            request_id=i,
            **sampling,
        )
        for i, row in enumerate(rows)
    ]
    engine = SpeculativeEngine(target.model, drafter, policy=args.policy, max_batch_size=args.concurrency)
    outputs = engine.generate(requests, progress=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as handle:
        for row, output in zip(rows, outputs):
            record = {
                "prompt": row["prompt"],
                "response": target.tokenizer.decode(output.output_ids, skip_special_tokens=True),
                "new_tokens": len(output.output_ids),
                "finish_reason": output.finish_reason,
                "error": output.error,
                "tau": output.stats.tau,
            }
            handle.write(json.dumps(record) + "\n")
    stats = engine.stats
    print(
        f"{len(outputs)} requests, {stats.generated_tokens} tokens in {stats.seconds:.1f} s "
        f"({stats.generated_tokens / stats.seconds:.1f} tokens/s, up to {stats.peak_rows} at once) -> {args.output}"
    )
    failed = [output for output in outputs if output.finish_reason == "error"]
    if failed:
        print(
            f'angelspec batch: {len(failed)} of {len(outputs)} requests failed (finish_reason "error" in '
            f"{args.output}; the first: {failed[0].error})",
            file=sys.stderr,
        )
        sys.exit(1)


DEFAULT_HELDOUT = os.path.join(  # package data: an installed wheel has it
    os.path.dirname(os.path.abspath(__file__)),
    "data",
    "smollm2-135m-instruct",
    "heldout_responses.jsonl.gz",
)


def _estimate(args: argparse.Namespace) -> None:
    import json

    from .hub import load_drafter
    from .training import estimate_on_responses

    target = load_target_from_args(args)
    drafter = load_drafter(args.drafter, target.model, target.tokenizer)
    sources = args.sources.split(",") if args.sources else None
    metrics = estimate_on_responses(
        drafter, target.model, args.responses, sources, args.max_length, args.hidden_cache_dir, args.num_draft_tokens
    )
    depths = args.num_draft_tokens or drafter.generation_config.num_assistant_tokens
    print(f"{metrics['documents']} responses, {metrics['rounds']} rounds of greedy decoding, offline")
    print(
        f"τ {metrics['tau']:.3f}; by draft length: "
        + " ".join(f"{d}:{metrics[f'tau_depth_{d}']:.2f}" for d in range(1, depths + 1))
    )
    print(
        "acceptance by depth: "
        + " ".join(f"{metrics.get(f'acceptance_depth_{d}', 0.0):.2f}" for d in range(1, depths + 1))
    )
    for n in (1, 2, 4, 8):
        print(
            f"top-{n} recall by depth: "
            + " ".join(f"{metrics[f'recall_top{n}_depth_{d}']:.2f}" for d in range(1, depths + 1))
        )
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"command": args.command_line, "drafter": args.drafter, **metrics}, handle, indent=1)


def _curve(args: argparse.Namespace) -> None:
    from .training.curves import curve_table, plot_training_curves, training_curve, trend_table

    labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.normpath(run)) for run in args.runs]
    if len(labels) != len(args.runs):
        raise UsageError(f"--labels names {len(labels)} runs, {len(args.runs)} were given")
    curves = {label: training_curve(run) for label, run in zip(labels, args.runs)}
    print(curve_table(curves))
    if args.target_tau is not None:
        print("\nTrends (τ against the logarithm of CPU-hours and of tokens, over each run's later half):")
        print(trend_table(curves, args.target_tau))
    if args.output:
        print(f"-> {plot_training_curves(curves, args.output, target_tau=args.target_tau)}")


def _export(args: argparse.Namespace) -> None:
    import torch

    from .export import EXPORT_FORMATS
    from .hub import load_drafter

    drafter = load_drafter(args.drafter)
    try:
        folder = EXPORT_FORMATS[args.format](
            drafter, args.output, dtype=getattr(torch, args.dtype) if args.dtype else None
        )
    except ValueError as error:
        raise UsageError(f"--drafter {args.drafter}: {error}") from None
    print(f"{args.format} checkpoint in {folder}")


def _index_outputs(args: argparse.Namespace) -> None:
    from .hub import load_drafter
    from .models.router.modeling_router import RouterDrafter
    from .models.suffix.modeling_suffix import SuffixDrafter
    from .training.regenerate import read_responses

    missing = [path for path in args.responses.split(",") if not os.path.isfile(path)]
    if missing:
        raise UsageError(f"--responses: no such file {missing[0]}")
    drafter = load_drafter(args.drafter)
    suffix = drafter
    if isinstance(drafter, RouterDrafter):  # the router's suffix member
        suffix = next((member for member in drafter.members if isinstance(member, SuffixDrafter)), None)
    if not isinstance(suffix, SuffixDrafter):
        raise UsageError(f"--drafter {args.drafter}: neither a suffix drafter nor a router with a suffix member")
    records = []
    for path in args.responses.split(","):
        ours = read_responses(path)
        for record in ours:
            ids = record["response_ids"]
            record["response_ids"] = ids if isinstance(ids, list) else json.loads(ids)
        try:  # an id the target cannot read would break decoding for every request matching its text
            suffix.check_token_ids([record["response_ids"] for record in ours], path)
        except ValueError as error:
            raise UsageError(str(error)) from None
        records += ours
    if args.exclude:  # evaluation prompts: their responses would replay the answers a benchmark asks for
        from .prompts import normalize_prompt, prompts_of

        excluded = prompts_of(args.exclude.split(","), data_dir=args.data_dir)
        kept = [record for record in records if normalize_prompt(record["prompt"]) not in excluded]
        print(f"{len(records) - len(kept)} responses left out: their prompts are in {args.exclude}")
        records = kept
    responses = [record["response_ids"] for record in records]
    suffix.index_outputs(responses, args.max_tokens)
    drafter.save_pretrained(args.output)
    print(
        f"{len(responses)} responses into the shared index of {args.output}: "
        f"{len(suffix.shared_index)} tokens (at most {suffix.config.shared_index_max_tokens})"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="angelspec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_command(name: str, **options) -> argparse.ArgumentParser:  # each command's --help shows its defaults
        return commands.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter, **options)

    regenerate = add_command("regenerate", help="regenerate training responses with the target itself")
    add_target_arguments(regenerate)
    regenerate.add_argument(
        "--sources", required=True, help="comma-separated prompt sets, e.g. alpaca_eval,arena_hard"
    )
    regenerate.add_argument("--output", required=True, help="gzipped JSONL file, appended to (resumable)")
    regenerate.add_argument("--data-dir", default=None)
    regenerate.add_argument("--limit-per-source", type=positive_int, default=None)
    regenerate.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    regenerate.add_argument("--max-new-tokens", type=positive_int, default=256)
    regenerate.add_argument("--batch-size", type=positive_int, default=16, help="requests decoded together (refilled)")
    regenerate.add_argument(
        "--temperature", type=temperature, default=0.0, help="0 (default): greedy; > 0: sampled, one seed per prompt"
    )
    regenerate.add_argument("--seed", type=int, default=0, help="first sampling seed (prompt i gets seed + i)")
    regenerate.add_argument(
        "--exclude",
        default=None,
        help="prompt sets (comma-separated, e.g. the evaluation sets) whose prompts are skipped",
    )

    teacher_forced = add_command(
        "teacher-forced", help="existing text (prompt sets' own answers, Python sources) as training responses"
    )
    teacher_forced.add_argument("--target", default="smollm2", help="whose tokenizer and chat template")
    teacher_forced.add_argument(
        "--sources", default="", help="comma-separated prompt sets with answers, e.g. gsm8k_train"
    )
    teacher_forced.add_argument("--python-source", default=None, help="a folder of .py files ('stdlib': Python's own)")
    teacher_forced.add_argument("--output", required=True, help="gzipped JSONL file (replaced)")
    teacher_forced.add_argument("--data-dir", default=None)
    teacher_forced.add_argument("--limit-per-source", type=positive_int, default=None)
    teacher_forced.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    teacher_forced.add_argument("--max-response-tokens", type=positive_int, default=1024)
    teacher_forced.add_argument(
        "--chunk-tokens", type=positive_int, default=768, help="tokens per Python-source response"
    )
    teacher_forced.set_defaults(func=_teacher_forced)
    regenerate.set_defaults(func=_regenerate)

    demo = add_command("demo", help="SmolLM2 with a shipped drafter (the suffix one): outputs, τ and speedup")
    add_target_arguments(demo)
    demo.add_argument("--drafter", default=DEFAULT_DRAFTER, help="a drafter folder, shipped drafter name or Hub id")
    demo.add_argument("--limit", type=positive_int, default=5, help="how many MT-bench prompts")
    demo.add_argument("--max-new-tokens", type=positive_int, default=128)
    demo.set_defaults(func=_demo)

    profile = add_command("profile", help="(re-)profile the target's verify-forward latency on this machine for D-cut")
    add_target_arguments(profile)
    profile.add_argument(
        "--rows", type=positive_int_list, default="1,2,4,8,16,32,64", help="comma-separated batch sizes to profile"
    )
    profile.add_argument("--repeats", type=positive_int, default=5)
    profile.add_argument("--output", default=None, help="JSON file (default: the cache D-cut reads)")
    profile.set_defaults(func=_profile)

    batch = add_command("batch", help="serve a prompt set through the batched engine, responses to JSONL")
    add_target_arguments(batch)
    batch.add_argument("--drafter", default=None, help="drafter folder (none: batched autoregressive decoding)")
    batch.add_argument("--prompts", default="mt_bench", help="prompt set name, mixture (a+b) or JSONL file")
    batch.add_argument("--data-dir", default=None)
    batch.add_argument("--limit", type=positive_int, default=None)
    batch.add_argument("--concurrency", type=positive_int, default=16, help="most requests decoded together")
    batch.add_argument("--policy", type=policy, default="dcut", help="verify policy: dcut, heuristic or constant-K")
    batch.add_argument("--max-new-tokens", type=positive_int, default=128)
    batch.add_argument(
        "--temperature",
        type=temperature,
        default=0.0,
        help="0 (default): greedy decoding; > 0: sample at this temperature",
    )
    batch.add_argument("--seed", type=int, default=0)
    batch.add_argument("--output", required=True, help="JSONL of responses")
    batch.set_defaults(func=_batch)

    estimate = add_command(
        "estimate", help="offline acceptance estimate of a drafter on held-out target responses (no target decoding)"
    )
    estimate.add_argument("--drafter", required=True)
    add_target_arguments(estimate)
    estimate.add_argument(
        "--responses", default=DEFAULT_HELDOUT, help="held-out target responses (angelspec regenerate)"
    )
    estimate.add_argument("--sources", default=None, help="only these sources of the responses file, comma-separated")
    estimate.add_argument("--num-draft-tokens", type=positive_int, default=None, help="default: the drafter's own")
    estimate.add_argument("--max-length", type=positive_int, default=1024, help="tokens per packed row")
    estimate.add_argument("--hidden-cache-dir", default=os.path.join(".cache", "hidden_states"))
    estimate.add_argument("--output", default=None, help="JSON file of the metrics")
    estimate.set_defaults(func=_estimate)

    export = add_command(
        "export", help="a trained drafter in the checkpoint layout SGLang / vLLM load (DFlash or EAGLE-3)"
    )
    export.add_argument("--drafter", required=True, help="a drafter folder, shipped drafter name or Hub id")
    export.add_argument(
        "--format", choices=["dflash", "eagle3"], default="dflash", help="the layout: dflash (DFly) or eagle3 (MTP)"
    )
    export.add_argument("--output", required=True, help="folder for model.safetensors and config.json")
    export.add_argument(
        "--dtype",
        choices=TARGET_DTYPES,
        default=None,
        help="tensor dtype (default: the drafter's)",
    )
    export.set_defaults(func=_export)

    curve = add_command("curve", help="offline τ of training runs against CPU-hours and tokens: table and plot")
    curve.add_argument(
        "runs", nargs="+", help="training output folders (their trainer_state.json), or trainer state files"
    )
    curve.add_argument("--labels", default=None, help="comma-separated, one per run (default: the folder names)")
    curve.add_argument(
        "--target-tau",
        type=float,
        default=None,
        help="draw this τ as a line, and print the CPU-hours and tokens at which each run's trend reaches it",
    )
    curve.add_argument("--output", default=None, help="PNG of the curves")
    curve.set_defaults(func=_curve)

    index = add_command(
        "index-outputs", help="seed a suffix drafter's shared index with the target's responses (a datastore)"
    )
    index.add_argument("--drafter", required=True, help="a suffix drafter, or a router with a suffix member")
    index.add_argument(
        "--responses", required=True, help="regenerated-responses files (gzipped JSONL), comma-separated"
    )
    index.add_argument("--max-tokens", type=positive_int, default=None, help="the index's bound (default: kept)")
    index.add_argument(
        "--exclude", default=None, help="prompt sets (comma-separated) whose prompts' responses are left out"
    )
    index.add_argument("--data-dir", default=None)
    index.add_argument("--output", required=True, help="the folder to save the drafter with its index to")
    index.set_defaults(func=_index_outputs)

    suite_parser = add_command(
        "suite", help="every method on every domain, plus the batched engine: JSON, Markdown, plots"
    )
    add_suite_arguments(suite_parser)
    suite_parser.set_defaults(func=_suite)

    bench = add_command("bench", help="speculative vs plain decoding on a prompt set")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")


def check_arguments(args: argparse.Namespace) -> None:
    """Check what the command line names on disk — models, prompt files, output paths — before any model loads;
    raise `UsageError` on the first mistake."""
    if getattr(args, "target", "smollm2") != "smollm2":
        folder, _, gguf_file = args.target.partition("::")
        _check_model("--target", folder, "target", filename=gguf_file or "config.json")
        if gguf_file and os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, gguf_file)):
            raise UsageError(f"--target {args.target}: no file {gguf_file} in {folder}")
    device = getattr(args, "device", "cpu")
    if device != "cpu":
        import torch

        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as error:
            raise UsageError(f"--device {device}: {str(error).splitlines()[0]}") from None
    if args.command == "bench":
        for spec in args.drafter:
            _check_model("--drafter", spec.partition("@")[0], "drafter", hub=False)
    elif getattr(args, "drafter", None):
        _check_model("--drafter", args.drafter, "drafter")
    if args.command in ("batch", "bench", "demo"):
        from .targets import target_context_length

        context = target_context_length(args.target)
        if context is not None and args.max_new_tokens >= context:
            raise UsageError(
                f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the target's context of "
                f"{context} positions"
            )
    data_dir = getattr(args, "data_dir", None)
    if data_dir is not None and not os.path.isdir(data_dir):
        raise UsageError(f"--data-dir {data_dir}: no such folder")
    if args.command == "suite" and not os.path.isdir(args.drafters_dir):
        raise UsageError(f"--drafters-dir {args.drafters_dir}: no such folder")
    if args.command == "curve" and not all(os.path.exists(run) for run in args.runs):
        missing = [run for run in args.runs if not os.path.exists(run)]
        raise UsageError(f"{missing}: no such training output folder or trainer state file")
    if args.command == "estimate" and not all(os.path.isfile(path) for path in args.responses.split(",")):
        raise UsageError(f"--responses {args.responses}: no such file (make one with `angelspec regenerate`)")
    if args.command == "teacher-forced":
        from .prompts import PROMPT_SETS

        unknown = [s for s in args.sources.split(",") if s and getattr(PROMPT_SETS.get(s), "reference", None) is None]
        if unknown:
            answered = ", ".join(name for name, spec in PROMPT_SETS.items() if spec.reference is not None)
            raise UsageError(f"--sources: {', '.join(unknown)} has no answers of its own; these do: {answered}")
        if not args.sources and args.python_source is None:
            raise UsageError("nothing to read: give --sources and/or --python-source")
        if args.python_source not in (None, "stdlib") and not os.path.isdir(args.python_source):
            raise UsageError(f"--python-source {args.python_source}: no such folder")
    if args.command == "regenerate":
        sources = args.sources.split(",") + (args.exclude.split(",") if args.exclude else [])
    elif args.command == "index-outputs":
        sources = args.exclude.split(",") if args.exclude else []
    else:
        sources = [args.prompts] if hasattr(args, "prompts") else []
    for source in sources:
        try:
            check_prompt_source(source, data_dir)
        except (OSError, ValueError) as error:
            raise UsageError(str(error)) from None
    for flag, dest in (("--output", "output"), ("--benchmarks-md", "benchmarks_md"), ("--output-dir", "output_dir")):
        if getattr(args, dest, None):
            folder = dest == "output_dir" or args.command == "index-outputs"  # that one saves a drafter folder
            _check_writable(flag, getattr(args, dest), folder=folder)
    if args.command == "bench" and args.concurrency and args.limit is not None:
        needed = max(max(int(c) for c in args.concurrency.split(",")), args.min_requests)
        if args.limit < needed:
            raise UsageError(
                f"--limit {args.limit} leaves too few prompts: --concurrency {args.concurrency} with --min-requests "
                f"{args.min_requests} needs {needed}"
            )


def _check_model(flag: str, path: str, kind: str, hub: bool = True, filename: str = "config.json") -> None:
    """`path` is a model folder, a shipped drafter's name, or, where `hub`, a Hub id (offline: one whose `filename`
    is in the local cache)."""
    if os.path.isdir(path):
        return
    if kind == "drafter":
        from .hub import shipped_drafter_path

        if shipped_drafter_path(path) is not None:
            return
    hub_id = hub and HUB_ID.fullmatch(path) is not None
    if hub_id and _on_hub(path, filename):
        return
    hint = " (and it is not a Hub id available offline)" if hub_id else ""
    raise UsageError(f"{flag} {path}: no {kind} folder of that name{hint}")


def _on_hub(repo_id: str, filename: str) -> bool:
    """Whether `from_pretrained(repo_id)` can find it: always assumed online, from the local cache offline."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() not in ("1", "ON", "YES", "TRUE"):
        return True
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)
    except ValueError:  # not a valid repo id after all (e.g. "a..b")
        return False


def _check_writable(flag: str, path: str, folder: bool = False) -> None:
    """`path` (a file, or a `folder`) can be written, missing parent folders created, without writing anything yet."""
    full = os.path.abspath(path)
    if os.path.isdir(full) != folder and os.path.exists(full):
        raise UsageError(f"{flag} {path}: " + ("not a folder" if folder else "is a folder"))
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) and existing != full:
        raise UsageError(f"{flag} {path}: cannot be created, {existing} is a file")
    if not os.access(existing, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot be written, {existing} is read-only")


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        check_arguments(args)
    except UsageError as error:
        print(f"angelspec {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)
    threads = (
        [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] if "OMP_NUM_THREADS" in os.environ else []
    )  # timings depend on it
    args.command_line = " ".join([*threads, "angelspec", *argv])
    try:
        args.func(args)
    except UsageError as error:  # found only once loaded (e.g. a drafter that has no such layout)
        print(f"angelspec {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
