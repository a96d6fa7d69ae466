"""Verify-policy labels, as `generate()` and the command line name them: transformers' `num_assistant_tokens_schedule`
names (`constant`, `heuristic`) and AngelSpec's `dcut`; a label is a schedule, or `constant-K` (K tokens per round).
Imports nothing heavy, so the command line checks a label before it loads anything (`policies.py` holds the
policies themselves)."""

from __future__ import annotations


CONSTANT, HEURISTIC, DCUT = "constant", "heuristic", "dcut"
SCHEDULES = (CONSTANT, HEURISTIC, DCUT)


def parse_label(label: str) -> tuple[str, int | None]:
    """A policy label as (schedule, tokens per round or None): `dcut`, `heuristic`, `constant` or `constant-K`."""
    name, dash, number = str(label).strip().partition("-")
    if name not in SCHEDULES or (dash and (name != CONSTANT or not number.isdigit() or int(number) < 1)):
        raise ValueError(
            f"Unknown verify policy {label!r}: num_assistant_tokens_schedule is one of {sorted(SCHEDULES)}; "
            "constant-K (K >= 1) also sets num_assistant_tokens"
        )
    return name, int(number) if dash else None
