"""Argument types of the `angelspec` command line: argparse reports a value they reject as
`angelspec CMD: error: argument --X: ...` and exits with status 2, before anything loads."""

from __future__ import annotations

import argparse
import math
import re


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


SCHEDULE = re.compile(r"dcut|heuristic|fixed-[1-9][0-9]*")


def schedule_list(text: str) -> str:
    """Comma-separated verify-depth schedules: `dcut`, `heuristic` or `fixed-K` (K >= 1)."""
    schedules = [schedule.strip() for schedule in text.split(",") if schedule.strip()]
    wrong = [schedule for schedule in schedules if not SCHEDULE.fullmatch(schedule)]
    if wrong or not schedules:
        raise argparse.ArgumentTypeError(
            f"{text!r}: schedules are dcut, heuristic or fixed-K with K >= 1, comma-separated (e.g. dcut,fixed-3)"
        )
    return ",".join(schedules)


def policy(text: str) -> str:
    """A batched-engine verify policy: `dcut`, `heuristic` or `fixed-K` (K >= 1)."""
    if not SCHEDULE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be dcut, heuristic or fixed-K with K >= 1 (e.g. fixed-3), got {text!r}")
    return text


def drafter_spec(text: str) -> str:
    """`DIR` or `DIR@SCHEDULES` (bench): the schedules are checked here, the folder by `check_arguments`."""
    path, _, schedules = text.partition("@")
    return f"{path}@{schedule_list(schedules)}" if schedules.strip() else path
