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


def temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0: greedy), got {text!r}")
    return value


def schedule_list(text: str) -> str:
    """Comma-separated verify policies (`policies.parse_label`): `dcut`, `heuristic`, `constant-K` (K >= 1)."""
    labels = [label.strip() for label in text.split(",") if label.strip()]
    if not labels:
        raise argparse.ArgumentTypeError(f"{text!r}: name at least one policy, e.g. dcut,constant-3")
    for label in labels:
        policy(label)
    return ",".join(labels)


def policy(text: str) -> str:
    """A verify policy label (`policies.parse_label`): `dcut`, `heuristic`, `constant` or `constant-K` (K >= 1)."""
    from .generation.policies import parse_label

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


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """`--target` with the dtype and device it loads in (the drafter follows the target's)."""
    parser.add_argument(
        "--target", default="smollm2", help="the embedded SmolLM2-135M-Instruct GGUF (smollm2), a folder or a Hub id"
    )
    parser.add_argument("--dtype", choices=TARGET_DTYPES, default="float32", help="the target's dtype")
    parser.add_argument("--device", default="cpu", help="the target's device (e.g. cuda:0)")
