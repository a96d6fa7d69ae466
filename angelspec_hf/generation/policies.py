"""Verify policies: how many tokens to draft and how many of them to verify, round by round.

One policy object serves a decoding run, the same in `generate()`'s candidate generator (one row) and in the
batched engine (many rows). Its names are transformers' generation-config names: `num_assistant_tokens_schedule`
is `"constant"` (verify `num_assistant_tokens` drafts per round), `"heuristic"` (transformers' rule: +2 after a
fully accepted round, -1 otherwise) or `"dcut"` (AngelSpec §4, the default for AngelSpec drafters), and
`num_assistant_tokens` is the most drafted per round. Command lines and benchmark tables name a policy by its
`label`: `dcut`, `heuristic`, or `constant-K`.

What a policy decides, in the order a round asks:

    draft_count   how many tokens to draft at most this round (0: skip drafting)
    keep_drafting after each sequential drafting step: whether another step can still pay
    depths        how many drafted tokens of each row to verify
    observe       what it learns from how many each row accepted
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from .dcut import ConfidenceCalibrator, DraftRound, dcut_depths, load_cost_model


REPROBE_ROUNDS = 8  # after this many rounds without drafting D-cut drafts once anyway, to keep its estimate current
MAX_REPROBE_ROUNDS = 64  # the interval doubles up to this while those probes confirm that drafting does not pay
PROFILED_ROWS = (1, 2, 4, 8, 16, 32, 64)


def profiled_rows(max_batch_size: int) -> list[int]:
    """Batch sizes to profile the verify cost at for batches of up to `max_batch_size` rows."""
    return [r for r in PROFILED_ROWS if r < max_batch_size] + [max_batch_size]


@dataclass
class RowState:
    """What a policy keeps per row (request): the `heuristic` schedule's current depth."""

    depth: int


class VerifyPolicy:
    """Base of the verify policies. `max_draft` is the most tokens drafted per round."""

    schedule: ClassVar[str]

    def __init__(self, max_draft: int):
        if not isinstance(max_draft, int) or isinstance(max_draft, bool) or max_draft < 1:
            raise ValueError(f"num_assistant_tokens must be a positive integer, got {max_draft!r}")
        self.max_draft = max_draft

    @property
    def label(self) -> str:
        return self.schedule

    def generation_settings(self) -> dict:
        """The drafter generation-config settings that select this policy."""
        return {"num_assistant_tokens_schedule": self.schedule, "num_assistant_tokens": self.max_draft}

    def start(self, target, drafter, max_rows: int = 1) -> None:
        """Prepare for a decoding run of up to `max_rows` rows with `drafter` on `target`."""

    def new_row(self) -> RowState:
        return RowState(depth=self.max_draft)

    def draft_count(self, rows: Sequence[RowState], budget: int) -> int:
        """Most tokens to draft this round for `rows`, none past `budget` (tokens the longest row may still add)."""
        return max(0, min(self.max_draft, budget))

    def keep_drafting(self, drafting: DraftRound, count: int) -> bool:
        """After a sequential drafting step: whether drafting on (up to `count`) can still pay."""
        return True

    def depths(
        self, drafting: DraftRound, caps: list[int], rows: Sequence[RowState], draft_seconds: float
    ) -> list[int]:
        """Drafted tokens to verify per row, each at most its `caps[r]` (length limit, usable draft scores)."""
        return list(caps)

    def observe(self, drafting: DraftRound, depths: list[int], accepted: list[int], rows: Sequence[RowState]) -> None:
        """Learn from a verified round: row r verified `depths[r]` drafts and accepted `accepted[r]` of them."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_draft={self.max_draft})"


class Constant(VerifyPolicy):
    """Verify `max_draft` drafted tokens every round (transformers' `constant` schedule)."""

    schedule = "constant"

    @property
    def label(self) -> str:
        return f"constant-{self.max_draft}"


class Heuristic(VerifyPolicy):
    """transformers' rule per row: start at `max_draft`, +2 after a fully accepted round, -1 (not below 1) otherwise."""

    schedule = "heuristic"

    def draft_count(self, rows, budget):
        return max(0, min(budget, max((row.depth for row in rows), default=0)))

    def depths(self, drafting, caps, rows, draft_seconds):
        return [min(cap, row.depth) for cap, row in zip(caps, rows)]

    def observe(self, drafting, depths, accepted, rows):
        for row, depth, count in zip(rows, depths, accepted):
            if depth:
                row.depth = min(self.max_draft, row.depth + 2) if count == depth else max(1, row.depth - 1)


class DCut(VerifyPolicy):
    """D-cut (AngelSpec §4): rank every drafted token of every row by calibrated confidence and verify the prefix of
    that ranking that maximises expected tokens per second under this machine's verify-cost profile (`dcut.py`).

    It also decides not to draft at all while drafting is not expected to pay (re-probing now and then), and stops
    sequential drafting early once no further step can raise the round's rate. The confidence calibrator lives on
    the drafter (`dcut_calibrator`), so it follows acceptance drift across `generate()` calls.
    """

    schedule = "dcut"

    def __init__(self, max_draft: int, cost_model=None):
        super().__init__(max_draft)
        self.cost_model = cost_model
        self.calibrator: ConfidenceCalibrator | None = None
        self.step_seconds = 0.0  # one sequential drafting step, measured (optimistic 0 until measured)
        self.first_draft_seconds: float | None = None  # running estimate: reading the verified tokens + first step
        self.depth_confidence: torch.Tensor | None = None  # running mean calibrated confidence per draft position
        self.rounds_without_draft = 0
        self.reprobe_interval = REPROBE_ROUNDS
        self.widths: list[float] = []  # this round's verify cost by width (1 + drafts per row)

    def start(self, target, drafter, max_rows=1):
        if self.cost_model is None:
            self.cost_model = load_cost_model(target, rows=profiled_rows(max_rows))
        if drafter.dcut_calibrator is None:
            drafter.dcut_calibrator = ConfidenceCalibrator()
        self.calibrator = drafter.dcut_calibrator

    def verify_seconds(self, rows: int, width: int) -> float:
        """This round's verify cost (looked up per width, for the round's batch size)."""
        return self.widths[width - 1]

    def draft_count(self, rows, budget):
        count = super().draft_count(rows, budget)
        self.widths = [self.cost_model(len(rows), width) for width in range(1, self.max_draft + 2)]
        return count if count and self._drafting_expected_to_pay(len(rows)) else 0

    def _drafting_expected_to_pay(self, rows: int) -> bool:
        """Before drafting: with the mean calibrated confidence of each draft position over recent rounds (ĉ_k) and
        the drafting time of m tokens (first step plus m − 1 measured steps), would any verify width beat a round
        without drafts? While it would not, rounds skip drafting; a skipped round re-probes after `reprobe_interval`
        of them, an interval that doubles (up to `MAX_REPROBE_ROUNDS`) while probes confirm that drafting does not
        pay, so the estimate follows drift in acceptance and batch size."""
        if self.depth_confidence is None:
            return True
        if self.rounds_without_draft >= self.reprobe_interval:
            self.rounds_without_draft = 0
            self.reprobe_interval = min(2 * self.reprobe_interval, MAX_REPROBE_ROUNDS)
            return True
        no_draft = rows / self.widths[0]
        expected = rows * (1 + self.depth_confidence.cumsum(0))
        first_step = self.step_seconds if self.first_draft_seconds is None else self.first_draft_seconds
        pays = any(
            float(expected[m - 1]) / (first_step + (m - 1) * self.step_seconds + self.widths[m]) > no_draft
            for m in range(1, len(self.widths))
        )
        if pays:
            self.rounds_without_draft, self.reprobe_interval = 0, REPROBE_ROUNDS
        else:
            self.rounds_without_draft += 1
        return pays

    def keep_drafting(self, drafting, count):
        self.step_seconds = drafting.step_seconds(self.step_seconds)
        return drafting.worth_continuing(self.calibrator, self.verify_seconds, count, self.step_seconds)

    def depths(self, drafting, caps, rows, draft_seconds):
        drafted = len(drafting.probabilities)
        if not drafted:
            return [0] * len(caps)
        calibrated = self.calibrator(drafting.confidence()[:, :drafted])  # position k reads only steps ≤ k
        self._record_drafting(calibrated, drafting)
        confidences = [row[:cap] for row, cap in zip(calibrated, caps)]
        return dcut_depths(confidences, self.verify_seconds, draft_seconds, sampled=drafting.sampled.tolist())

    def _record_drafting(self, calibrated: torch.Tensor, drafting: DraftRound) -> None:
        """Exponential averages of the per-position mean calibrated confidence and of the first drafting step's time.
        A position the early exit did not reach keeps its estimate (the first time, that of the deepest drafted one),
        capped so that the estimates never grow with depth. A round that read a backlog (a new prompt, or tokens
        left by skipped rounds) says nothing about a usual first step's time."""
        drafted = calibrated.shape[1]
        mean = calibrated.mean(0)
        if self.depth_confidence is None:
            self.depth_confidence = mean[-1].repeat(self.max_draft)
            self.depth_confidence[:drafted] = mean
        else:
            self.depth_confidence[:drafted] = 0.8 * self.depth_confidence[:drafted] + 0.2 * mean
        self.depth_confidence = self.depth_confidence.cummin(0).values
        if not drafting.reads_backlog:
            first = drafting.first_step_seconds()
            self.first_draft_seconds = (
                first if self.first_draft_seconds is None else 0.8 * self.first_draft_seconds + 0.2 * first
            )

    def observe(self, drafting, depths, accepted, rows):
        verified = [r for r, depth in enumerate(depths) if depth]
        if not verified:
            return
        confidence = drafting.confidence()
        self.calibrator.update(
            torch.cat([confidence[r, : depths[r]] for r in verified]),
            torch.cat([torch.arange(depths[r]) < accepted[r] for r in verified]),
        )


POLICIES: dict[str, type[VerifyPolicy]] = {policy.schedule: policy for policy in (Constant, Heuristic, DCut)}


def parse_label(label: str) -> tuple[str, int | None]:
    """A policy label as (schedule, tokens per round or None): `dcut`, `heuristic`, `constant` or `constant-K`."""
    name, dash, number = str(label).strip().partition("-")
    if name not in POLICIES or (dash and (name != "constant" or not number.isdigit() or int(number) < 1)):
        raise ValueError(
            f"Unknown verify policy {label!r}: num_assistant_tokens_schedule is one of {sorted(POLICIES)}; "
            "constant-K (K >= 1) also sets num_assistant_tokens"
        )
    return name, int(number) if dash else None


def resolve_policy(policy: VerifyPolicy | str | None, drafter, cost_model=None) -> VerifyPolicy:
    """The one place a verify policy is chosen.

    `policy` may be a `VerifyPolicy` (used as is), a label (`parse_label`; without a count it drafts the drafter's
    `num_assistant_tokens`), or None: the drafter's generation config (`num_assistant_tokens_schedule`, default
    `"dcut"`, and `num_assistant_tokens`), as `generate()` reads it.
    """
    if isinstance(policy, VerifyPolicy):
        return policy
    config = drafter.generation_config
    name, count = parse_label(config.num_assistant_tokens_schedule or "dcut" if policy is None else policy)
    count = count or int(config.num_assistant_tokens)
    most = drafter.max_num_draft_tokens()
    if most is not None and count > most:
        raise ValueError(f"{policy or name}: this drafter drafts at most {most} tokens per round, not {count}")
    return DCut(count, cost_model) if name == "dcut" else POLICIES[name](count)


def draft_round(
    drafter,
    state,
    policy: VerifyPolicy,
    rows: Sequence[RowState],
    hidden,
    tokens,
    count: int,
    temperatures: torch.Tensor,
    sampled: Sequence[bool],
    generators=None,
    new_lengths=None,
) -> tuple[torch.LongTensor, torch.Tensor, DraftRound]:
    """One drafting round, the same for `generate()` and the engine: the drafter reads the verified tokens (`tokens`
    with their target `hidden` states) and drafts up to `count` tokens per row, each picked by a `DraftRound`
    (argmax, or a draw from q = softmax(logits / T) with the draft probability recorded), stopping early when the
    policy says another step cannot pay. Returns the drafts [B, K] (target vocabulary), their draft logits and the
    round's record (confidences, usable steps, timing)."""
    reads_backlog = tokens.shape[1] > policy.max_draft + 1  # after skipped rounds, or a new prompt
    drafting = DraftRound(temperatures, sampled=sampled, generators=generators, reads_backlog=reads_backlog)
    draft_ids, logits = drafter.propose(
        state,
        hidden,
        tokens,
        count,
        drafting.choose,
        keep_drafting=lambda: policy.keep_drafting(drafting, count),
        new_lengths=new_lengths,
    )
    drafting.seconds = time.perf_counter() - drafting.start
    return draft_ids, logits, drafting
