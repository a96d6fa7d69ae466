"""Acceptance metrics of speculative decoding, shared by generation, the Trainer callback and the benchmark.

τ (mean acceptance length) is tokens produced per target forward, the bonus token included, so plain decoding has
τ = 1. Acceptance at depth k is the rate at which the k-th draft token is accepted when it was drafted and every
earlier one was accepted (the per-position acceptance of EAGLE and Spec-Bench).

`SpeculationStats` records rounds as they happen; `acceptance_metric.SpeculativeAcceptance` is the same computation
as an `evaluate` metric. This module imports neither `evaluate` nor `datasets` (seconds at start-up): the generation
code and every command import it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def round_profile(round_seconds: list[tuple[float, float, float]]) -> dict | None:
    """Where a decoding round's time goes: the median over rounds of the milliseconds in the target forward, in
    drafting, and in the rest (the generation loop, the verify policy, acceptance, cache trimming: what a lean loop
    removes), from (forward, drafting, whole round) seconds per round; None without timed rounds."""
    if not round_seconds:
        return None
    return {
        "target_forward_ms": 1000 * statistics.median(f for f, _, _ in round_seconds),
        "draft_ms": 1000 * statistics.median(d for _, d, _ in round_seconds),
        "rest_ms": 1000 * statistics.median(w - f - d for f, d, w in round_seconds),
        "rounds": len(round_seconds),
    }


def format_round_profile(profile: dict | None) -> str:
    """A round profile as "target / draft / rest" milliseconds ("—" where no round was timed)."""
    if not profile:
        return "—"
    return f"{profile['target_forward_ms']:.1f} / {profile['draft_ms']:.1f} / {profile['rest_ms']:.1f}"


@dataclass
class SpeculationStats:
    """Per-round record of drafted and accepted token counts, and drafting time, in total and by phase: the first
    draft token (the drafter reading the verified tokens, plus its first step: MTP's depth 1, DFly's block
    backbone and first head call) and the further sequential steps (MTP depths, DFly's AR head). Add two stats to
    pool them."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # (target forward, drafting, whole round) seconds of each timed round: from one drafting round to the next
    round_seconds: list[tuple[float, float, float]] = field(default_factory=list)

    def add_drafting_time(self, drafting) -> None:
        """Add a finished drafting round's time (a `DraftRound`), split into the first token and the further ones."""
        first = min(drafting.first_step_seconds(), drafting.seconds)
        self.draft_seconds += drafting.seconds
        for name, seconds in (("draft_first_token", first), ("draft_further_tokens", drafting.seconds - first)):
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    def record_round(self, drafted: int, accepted: int) -> None:
        self.drafted.append(drafted)
        self.accepted.append(accepted)

    def record_round_time(self, forward: float, draft: float, whole: float) -> None:
        """A round's seconds: in the target forward, in drafting, in all (the rest is the loop's own work)."""
        self.round_seconds.append((forward, draft, whole))

    def round_profile(self) -> dict | None:
        """The median per-round milliseconds of the target forward, of drafting and of the rest (`round_profile`)."""
        return round_profile(self.round_seconds)

    def __add__(self, other: "SpeculationStats") -> "SpeculationStats":
        phases = dict(self.phase_seconds)
        for name, seconds in other.phase_seconds.items():
            phases[name] = phases.get(name, 0.0) + seconds
        return SpeculationStats(
            self.drafted + other.drafted,
            self.accepted + other.accepted,
            self.draft_seconds + other.draft_seconds,
            phases,
            self.round_seconds + other.round_seconds,
        )

    @property
    def target_forwards(self) -> int:
        return len(self.drafted)

    @property
    def tokens(self) -> int:
        return sum(self.accepted) + len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward, bonus included."""
        return self.tokens / self.target_forwards if self.drafted else 0.0

    def acceptance_by_depth(self) -> list[float]:
        """Acceptance rate of draft position k (1-based), given positions 1..k-1 were accepted."""
        rates = []
        for depth in range(1, max(self.drafted, default=0) + 1):
            tried = sum(1 for d, a in zip(self.drafted, self.accepted) if d >= depth and a >= depth - 1)
            passed = sum(1 for d, a in zip(self.drafted, self.accepted) if d >= depth and a >= depth)
            rates.append(passed / tried if tried else 0.0)
        return rates

    def summary(self) -> dict:
        return {
            "tau": self.tau,
            "acceptance_by_depth": self.acceptance_by_depth(),
            "target_forwards": self.target_forwards,
            "tokens": self.tokens,
            "draft_seconds": self.draft_seconds,
            "round_profile": self.round_profile(),
        }
