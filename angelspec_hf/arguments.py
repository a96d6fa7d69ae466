"""Argument types of the `angelspec` command line: argparse reports a value they reject as
`angelspec CMD: error: argument --X: ...` and exits with status 2, before anything loads."""

from __future__ import annotations

import argparse
import math


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a positive integer, got {text!r}")
    return value


def positive_int_list(text: str) -> str:
    """Comma-separated positive integers (e.g. `1,4,16`), returned as such without spaces."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdecimal() and int(item) > 0 for item in items):
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers (e.g. 1,4,16), got {text!r}")
    return ",".join(str(int(item)) for item in items)


def int_list(text: str) -> list[int]:
    """One integer or several, comma-separated (e.g. `1000,5000`)."""
    try:
        return [_int(item) for item in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer or comma-separated integers, got {text!r}") from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def positive_float_list(text: str) -> str:
    """Comma-separated positive numbers (e.g. `0.5,1`), returned as given."""
    try:
        for item in text.split(","):
            positive_float(item)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated positive numbers (e.g. 0.5,1), got {text!r}"
        ) from None
    return text


def temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0: greedy), got {text!r}")
    return value


def schedule_list(text: str) -> str:
    """Comma-separated verify policies (`schedules.parse_label`): `dcut`, `heuristic`, `constant-K` (K >= 1)."""
    labels = [label.strip() for label in text.split(",") if label.strip()]
    if not labels:
        raise argparse.ArgumentTypeError(f"{text!r}: name at least one policy, e.g. dcut,constant-3")
    for label in labels:
        policy(label)
    return ",".join(labels)


def policy(text: str) -> str:
    """A verify policy label (`schedules.parse_label`): `dcut`, `heuristic`, `constant` or `constant-K` (K >= 1)."""
    from .generation.schedules import parse_label

    try:
        parse_label(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip()


def drafter_spec(text: str) -> str:
    """`DIR` or `DIR@SCHEDULES` (bench): the schedules are checked here, the folder by `check_arguments`."""
    path, _, schedules = text.partition("@")
    return f"{path}@{schedule_list(schedules)}" if schedules.strip() else path


TARGET_DTYPES = ("float32", "bfloat16", "float16")


def add_target_arguments(parser: argparse.ArgumentParser, auto_dtype: str | None = None) -> None:
    """`--target` with the dtype and device it loads in (the drafter follows the target's); with `auto_dtype` (what
    is measured) `--dtype auto` is offered too: the faster of float32 and bfloat16 for that on this machine."""
    parser.add_argument(
        "--target", default="smollm2", help="the embedded SmolLM2-135M-Instruct GGUF (smollm2), a folder or a Hub id"
    )
    parser.add_argument(
        "--dtype",
        choices=TARGET_DTYPES + (("auto",) if auto_dtype else ()),
        default="float32",
        help="the target's dtype"
        + (
            f"; auto: bfloat16 where it {auto_dtype} at least 1.1x faster than float32 on this machine"
            if auto_dtype
            else ""
        ),
    )
    parser.add_argument("--device", default="cpu", help="the target's device (e.g. cuda:0)")
    parser.add_argument(
        "--linear-kernels",
        choices=("tuned", "default"),
        default="tuned",
        help="tuned: on a CPU the target's linear layers run the fastest GEMM per row count measured on this machine "
        "(cached); default: PyTorch's own F.linear",
    )


def load_target_from_args(args: argparse.Namespace):
    """The target `add_target_arguments`' options name."""
    from .targets import load_target

    return load_target(args.target, dtype=args.dtype, device=args.device, tune_kernels=args.linear_kernels == "tuned")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`angelspec bench`: drafters against plain decoding, one sequence at a time or batched (`--concurrency`)."""
    add_target_arguments(parser)
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        type=drafter_spec,
        help="drafter folder, shipped drafter name or Hub id; repeat for several; DIR@SCHEDULES runs that drafter with its own schedules (e.g. DIR@dcut,constant-15)",
    )
    parser.add_argument("--prompts", default="mt_bench", help="prompt set name or JSONL file (`prompt` or `turns`)")
    parser.add_argument("--data-dir", default=None, help="local prompt folder (default ../shared/data)")
    parser.add_argument("--limit", type=positive_int, default=None, help="first N prompts")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument(
        "--num-draft-tokens", type=positive_int, default=None, help="override each drafter's most tokens per round"
    )
    parser.add_argument(
        "--schedules",
        default="dcut",
        type=schedule_list,
        help="comma-separated verify-depth schedules to run each drafter with: dcut (adaptive, default), "
        "constant-K (verify K drafted tokens, e.g. constant-1,constant-3), heuristic (transformers' rule)",
    )
    parser.add_argument(
        "--full-vocab-variant",
        action="store_true",
        help="also run each reduced-vocabulary drafter with the target's full lm_head (what the reduced head saves)",
    )
    parser.add_argument(
        "--concurrency",
        default=None,
        type=positive_int_list,
        help="comma-separated request concurrencies (e.g. 1,4,8,16,32,64): benchmark the batched engine instead, "
        "batched AR vs each drafter with each policy (dcut, constant-K) at each concurrency",
    )
    parser.add_argument(
        "--min-requests", type=positive_int, default=8, help="engine benchmark: requests per concurrency at least"
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="engine benchmark: drafters that learn from outputs keep what earlier runs served (each run is labelled "
        "with them); by default every run starts from the drafter as loaded",
    )
    parser.add_argument(
        "--prompt-lookup",
        type=non_negative_int,
        default=0,
        help="also run transformers' prompt lookup decoding with this many tokens per round (0: off)",
    )
    parser.add_argument(
        "--early-exit-assistant",
        type=non_negative_int,
        default=0,
        help="also run transformers' assisted generation (heuristic schedule) with an assistant made of the target's "
        "first N layers (0: off)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="time each generation (engine: each run, taking turns) this many times and report the median",
    )
    parser.add_argument("--output", default=None, help="write results as JSON here")
    parser.add_argument("--markdown", action="store_true", help="also print the results as a Markdown table")


def add_suite_arguments(parser: argparse.ArgumentParser) -> None:
    """`angelspec suite`: every method on every domain, plus the batched engine."""
    add_target_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="a small slice (one prompt per domain, short outputs)")
    parser.add_argument("--drafters-dir", default="model_cards", help="folder holding the drafter model cards")
    parser.add_argument("--data-dir", default=None, help="local prompt folder (default ../shared/data)")
    parser.add_argument(
        "--prompts-per-domain", type=positive_int, default=None, help="override the size's prompts per domain"
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=None, help="override the size's new tokens per prompt"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=None, help="time each generation this many times (median)"
    )
    parser.add_argument(
        "--ablations",
        action="store_true",
        help="also MTP without TTT, transformers' DFlash generator and assisted generation on an early-exit assistant",
    )
    parser.add_argument(
        "--output-dir",
        default="benchmarks/latest",
        help="results.json, the PNG plots and the finished parts (a rerun resumes after the last one)",
    )
    parser.add_argument("--fresh", action="store_true", help="measure every part again instead of resuming")
    parser.add_argument("--benchmarks-md", default=None, help="write the Markdown report here (e.g. BENCHMARKS.md)")
    parser.add_argument(
        "--update-model-cards",
        action="store_true",
        help="rewrite the suite section of each drafter's model card README from this run",
    )
