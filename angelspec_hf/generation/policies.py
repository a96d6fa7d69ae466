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
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch

from .dcut import ConfidenceCalibrator, dcut_depths, observed_steps
from .draft_round import DraftRound
from .schedules import CONSTANT, DCUT, HEURISTIC, parse_label
from .verify_cost import CorrectedCost, VerifyCost, load_cost_model


EXPLORATION_SHARE = 0.02  # most of a run's expected decoding time D-cut spends on drafting it does not expect to pay
GAIN_WINDOW = 20  # ĝ averages over about this many no-draft rounds' worth of drafting rounds (`DCut._record_gain`)
PRIOR_ROUNDS = 4  # the g that the mean confidences promise (`DCut.saved_fraction`) counts as this many in ĝ
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
    cost_model: VerifyCost | None = None  # the verify cost it prices with, if it prices

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

    def start(self, target, drafter, memory, max_rows: int = 1, promise_counts_catch_up: bool = False) -> None:
        """Prepare for a decoding run of up to `max_rows` rows with `drafter` on `target`, starting from what
        decoding learned of it before (`memory`, a `session.DrafterMemory`); `promise_counts_catch_up`: the
        round's promised gain (a routing plan's) already prices the drafter's catch-up on waiting tokens."""

    def new_row(self) -> RowState:
        return RowState(depth=self.max_draft)

    def draft_count(
        self, rows: Sequence[RowState], budget: int, backlog: int, promised_gain: float | None = None
    ) -> int:
        """Most tokens to draft this round for `rows`, none past `budget` (tokens the longest row may still add);
        the drafter has `backlog` verified tokens (of the row with most) to read first, and promises to save
        `promised_gain` of the round's time when it knows (a routing plan, or the drafter's `promised_gain`)."""
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

    schedule = CONSTANT

    @property
    def label(self) -> str:
        return f"constant-{self.max_draft}"


class Heuristic(VerifyPolicy):
    """transformers' rule per row: start at `max_draft`, +2 after a fully accepted round, -1 (not below 1) otherwise."""

    schedule = HEURISTIC

    def draft_count(self, rows, budget, backlog, promised_gain=None):
        return max(0, min(budget, max((row.depth for row in rows), default=0)))

    def depths(self, drafting, caps, rows, draft_seconds):
        return [min(cap, row.depth) for cap, row in zip(caps, rows)]

    def observe(self, drafting, depths, accepted, rows):
        for row, depth, count in zip(rows, depths, accepted):
            if depth:
                row.depth = min(self.max_draft, row.depth + 2) if count == depth else max(1, row.depth - 1)


@dataclass
class DrafterEstimates:
    """What D-cut learns about a drafter on this machine, kept across decoding runs (`session.DrafterMemory`) so
    that each run starts from it: the confidence calibrator, the mean calibrated confidence of each draft position
    (ĉ_k; until the drafter has drafted, its shipped offline acceptance, `PRIOR_ACCEPTANCE`, or None), `read_ratio`, the time the drafter takes to read verified tokens
    over the time the target takes to verify as many (both for the same rows), and `drafting_gain` ĝ per batch size:
    what drafting saves depends on what verifying costs, which grows with the rows (a drafter that pays alone may
    lose in a batch of 16), so a batch size's first rounds read the mean confidences, not another size's ĝ."""

    read_ratio: float
    calibrator: ConfidenceCalibrator = field(default_factory=ConfidenceCalibrator)
    depth_confidence: torch.Tensor | None = None
    # ĝ by batch size: the saved fraction that drafting rounds' chosen cuts promised, averaged
    drafting_gain: dict[int, float] = field(default_factory=dict)
    # what each ĝ rests on, in no-draft rounds' worth of tokens (PRIOR_ROUNDS included where it started from the
    # mean confidences), at most GAIN_WINDOW
    gain_weight: dict[int, float] = field(default_factory=dict)
    # The exploration budget's account (`DCut.may_explore`), over every run since the memory began: the rounds
    # decoded, each at the no-draft verify cost, and what drafting not expected to pay spent. Kept per run, a
    # drafter that stopped paying was never re-probed: its probe reads the request's whole backlog (80-140 ms for
    # DFly on a 2-core CPU), a run's 2 % of 128 tokens reaches about 100 ms only at its end, and the backlog grows as
    # fast as the budget (after 8 MT-bench prompts DFly drafted no round on 6 GSM8K prompts, where 2 a round gave
    # 1.22x).
    decoded_seconds: float = 0.0
    explored_seconds: float = 0.0


def parameter_ratio(drafter, target) -> float:
    """A first guess of `read_ratio` before any measurement: the drafter's own parameters (not the target's, nor a
    draft vocabulary head, which reads only the last position) over the target decoder's (embeddings excluded)."""
    shared = {parameter.data_ptr() for parameter in target.parameters()}
    own = sum(
        p.numel() for name, p in drafter.named_parameters() if p.data_ptr() not in shared and "lm_head" not in name
    )
    decoder = target.get_decoder()
    body = sum(p.numel() for p in decoder.parameters()) - decoder.get_input_embeddings().weight.numel()
    return own / max(body, 1)


PRIOR_ACCEPTANCE = "dcut_prior_acceptance"
"""The generation-config field in which a drafter ships its offline acceptance, P(its first k drafts are accepted)
for k = 1, 2, ... (`angelspec estimate --write-prior`): D-cut's ĉ_k before it has measured any, where a single
first probe would otherwise set them (a probe that happens to draft badly and sets ĉ_1 to 0.15 for a drafter
accepted 40 % of the time offline stops it from drafting again: the shipped DFly on GSM8K)."""


def prior_depth_confidence(drafter, max_draft: int) -> torch.Tensor | None:
    """ĉ_1..ĉ_max_draft from the drafter's `PRIOR_ACCEPTANCE` (deeper positions take the last one given), None
    when it ships none."""
    prior = getattr(drafter.generation_config, PRIOR_ACCEPTANCE, None)
    if prior is None:
        return None
    values = list(prior) if isinstance(prior, (list, tuple)) else None
    if (
        not values
        or not all(isinstance(v, (int, float)) and 0.0 <= v <= 1.0 for v in values)
        or any(b > a for a, b in zip(values, values[1:]))
    ):
        raise ValueError(
            f"{PRIOR_ACCEPTANCE} must be a non-empty, non-increasing list of probabilities (P(the first k drafts "
            f"are accepted), k = 1, 2, ...), got {prior!r}"
        )
    values = (values + values[-1:] * max_draft)[:max_draft]
    return torch.tensor(values, dtype=torch.float32)


class DCut(VerifyPolicy):
    """D-cut (AngelSpec §4): rank every drafted token of every row by calibrated confidence and verify the prefix of
    that ranking that maximises expected tokens per second under this machine's verify-cost profile (`dcut.py`).

    Whether to draft at all is priced by the same profile. A drafting round whose cut verifies depths n_r promises
    the rate r = (R + Σ_r Σ_{k≤n_r} c_rk) / (t_draft + t_v(R, 1 + max_r n_r)) against r_0 = R / t_v(R, 1) without
    drafts, so it saves the fraction g = 1 − r_0 / r of a round's time; ĝ, the average g of drafting rounds, prices
    the next one. Because each round's cut sees its own confidences (verifying nothing when they are low), ĝ can be
    positive where the mean confidence ĉ_k would not pay: a drafter that is sure on some rounds and lost on others
    (suffix matches) pays on the sure ones. Before ĝ is known, g is read off the mean confidences:
    g = 1 − r_0 / max_m r_m, r_m = R(1 + Σ_{k≤m} ĉ_k) / (t_draft(m) + t_v(R, 1 + m)). The drafter's
    catch-up (reading a backlog of verified tokens left by skipped rounds or a new prompt, beyond a usual round's
    1 + max_draft) costs `read_ratio` × (t_v(R, backlog) − t_v(R, 1 + max_draft)), and a round drafts when g > 0 and
    g repays that catch-up over the time the batch has left. Otherwise it drafts only as exploration (an unknown drafter, or one not expected to
    pay, re-probed so that ĉ follows drift), within `EXPLORATION_SHARE` of the decoding time of every run since the
    drafter's memory began (`may_explore`, `DrafterEstimates.decoded_seconds`);
    such a probe verifies at least each row's first draft, whatever the cut says: its calibrated confidences are
    what the probe is to correct, and a probe they cut to nothing taught the calibrator nothing (the suite of
    2026-12-07: DFly, after MT-bench prompts where it lost, never drafted again on GSM8K and MBPP, where two drafts
    a round gave 1.22x). The probe's price in `may_explore` counts that verified draft already.
    Sequential drafting stops early once no further step can raise the round's rate.
    """

    schedule = DCUT

    def __init__(self, max_draft: int, cost_model: VerifyCost | None = None):
        super().__init__(max_draft)
        self.cost_model = cost_model
        self.estimates: DrafterEstimates | None = None
        self.step_seconds = 0.0  # one sequential drafting step, measured (optimistic 0 until measured)
        self.first_draft_seconds: float | None = None  # running estimate: reading a round's tokens + first step
        self.exploring = False  # this round drafts as exploration
        self.probe_seconds = 0.0  # what this round's exploration was estimated to cost
        self.rows = 1
        self.widths: list[float] = []  # this round's verify cost by width (1 + drafts per row)
        self.promised_gain: float | None = None  # what the drafter promised this round would save, if it knows
        self.drafter_prices_catch_up = False  # the round's promise includes the catch-up (a routing plan's)

    @property
    def calibrator(self) -> ConfidenceCalibrator:
        return self.estimates.calibrator

    @property
    def depth_confidence(self) -> torch.Tensor | None:
        return self.estimates.depth_confidence

    def start(self, target, drafter, memory, max_rows=1, promise_counts_catch_up=False):
        if self.cost_model is None:
            self.cost_model = load_cost_model(target, rows=profiled_rows(max_rows))
        self.cost_model = CorrectedCost.of(self.cost_model)  # priced as this run's forwards turn out
        self.drafter_prices_catch_up = promise_counts_catch_up
        if memory.estimates is None:
            memory.estimates = DrafterEstimates(
                read_ratio=parameter_ratio(drafter, target),
                depth_confidence=prior_depth_confidence(drafter, self.max_draft),
            )
        self.estimates = memory.estimates

    def verify_seconds(self, rows: int, width: int) -> float:
        """This round's verify cost (looked up per width, for the round's batch size)."""
        return self.widths[width - 1]

    def first_step_seconds(self) -> float:
        """A usual round's first drafting step (reading up to 1 + max_draft verified tokens): measured, or at first
        `read_ratio` × t_v(R, 1 + max_draft)."""
        if self.first_draft_seconds is not None:
            return self.first_draft_seconds
        return self.estimates.read_ratio * self.cost_model(self.rows, self.max_draft + 1)

    def catch_up_seconds(self, backlog: int) -> float:
        """The drafter's extra time to read `backlog` verified tokens per row instead of a usual round's; none for a
        round whose promise prices it already (a routing plan's counts what the chosen members have to read)."""
        if self.drafter_prices_catch_up:
            return 0.0
        usual = self.cost_model(self.rows, self.max_draft + 1)
        return self.estimates.read_ratio * max(0.0, self.cost_model(self.rows, backlog) - usual)

    def draft_count(self, rows, budget, backlog, promised_gain=None):
        count = super().draft_count(rows, budget, backlog)
        self.promised_gain = promised_gain
        self.rows = len(rows)
        self.widths = [self.cost_model(self.rows, width) for width in range(1, self.max_draft + 2)]
        self.estimates.decoded_seconds += self.widths[0]
        self.exploring = False
        if count and not self.drafting_pays(budget, backlog):
            self.exploring = self.may_explore(count, budget, backlog)
            return count if self.exploring else 0
        return count

    def drafting_pays(self, budget: int, backlog: int) -> bool:
        """Whether drafting this round is expected to pay: g > 0 (the drafter's promise, when it made one, else
        `saved_fraction`), and g repays the catch-up over the `budget` rounds the batch has left. In a batch of
        several rows a promise stands only while this batch size's drafting rounds have not lost time on average
        (ĝ ≥ 0): a drafter that reads for free promises a round whenever a row has a match, but drafting 16 rows
        costs 5-9 ms of a 110 ms round on a 2-core CPU, and there the cut verified drafts in one round of four
        (the suffix drafter at 16 requests, 0.91x batched AR). Alone, a promise stands (the rounds whose cut drops
        every draft would pull ĝ below zero and stop drafting on the rounds with a long match too)."""
        saved = (
            self.promised_gain if self.promised_gain is not None else self.saved_fraction(self.first_step_seconds())
        )
        measured = self.estimates.drafting_gain.get(self.rows)
        if self.promised_gain is not None and self.rows > 1 and measured is not None and measured < 0:
            saved = measured
        return saved is not None and saved > 0 and self.catch_up_seconds(backlog) <= saved * budget * self.widths[0]

    def may_explore(self, count: int, budget: int, backlog: int) -> bool:
        """Whether a drafting round not expected to pay (catch-up, `count` steps and a wider verify) fits in
        `EXPLORATION_SHARE` of the decoding time, counted at the no-draft cost per round: the rounds of every run
        since the drafter's memory began, and, while the drafter has never drafted, also the `budget` rounds left
        (an unknown drafter is tried early; a known one is re-probed only as the time decoded pays for it). The
        account banks at most two probes, so a drafter that stops paying after a long stretch of paying rounds is
        re-probed at the usual spacing, not in a burst. Charges the estimated cost."""
        probe = self.first_step_seconds() + self.catch_up_seconds(backlog) + (count - 1) * self.step_seconds
        probe += self.widths[1] - self.widths[0]
        estimates = self.estimates
        horizon = estimates.decoded_seconds + (budget * self.widths[0] if self.depth_confidence is None else 0.0)
        banked = EXPLORATION_SHARE * estimates.decoded_seconds - 2 * probe
        estimates.explored_seconds = max(estimates.explored_seconds, banked)
        if estimates.explored_seconds + probe > EXPLORATION_SHARE * horizon:
            return False
        estimates.explored_seconds += probe
        self.probe_seconds = probe
        return True

    def saved_fraction(self, first_step: float) -> float | None:
        """The fraction of a round's time drafting is expected to save (negative: it costs): ĝ once drafting rounds
        of this batch size have measured it, else g = 1 − r_0 / max_m r_m from the mean confidences; None before the
        drafter drafted."""
        if self.rows in self.estimates.drafting_gain:
            return self.estimates.drafting_gain[self.rows]
        if self.depth_confidence is None:
            return None
        expected = 1 + self.depth_confidence.cumsum(0)
        best = max(
            float(expected[m - 1]) / (first_step + (m - 1) * self.step_seconds + self.widths[m])
            for m in range(1, len(self.widths))
        )
        return 1 - (1 / self.widths[0]) / best

    def keep_drafting(self, drafting, count):
        self.step_seconds = drafting.step_seconds(self.step_seconds)
        return drafting.worth_continuing(self.calibrator, self.verify_seconds, count, self.step_seconds)

    def depths(self, drafting, caps, rows, draft_seconds):
        drafted = len(drafting.probabilities)
        if not drafted:
            self._record_gain(drafting, [], [0] * len(caps), draft_seconds)
            return [0] * len(caps)
        calibrated = drafting.confidence(self.calibrator)[:, :drafted]  # k: steps ≤ k
        self._record_drafting(calibrated, drafting)
        confidences = [row[:cap] for row, cap in zip(calibrated, caps)]
        depths = dcut_depths(confidences, self.verify_seconds, draft_seconds, sampled=drafting.sampled.tolist())
        if self.exploring:  # a probe verifies each row's first draft at least: a cut to none teaches ĉ nothing
            depths = [max(depth, min(1, len(row))) for depth, row in zip(depths, confidences)]
        self._record_gain(drafting, confidences, depths, draft_seconds)
        if self.exploring:  # what the probe cost over a round without drafts, in place of its estimate
            self.estimates.explored_seconds += (
                draft_seconds + self.widths[max(depths)] - self.widths[0] - self.probe_seconds
            )
        return depths

    def _record_gain(self, drafting: DraftRound, confidences, depths: list[int], draft_seconds: float) -> None:
        """Average into ĝ the saved fraction g = 1 − r_0 / r this round's cut promises, weighted by the tokens per row
        it promises (1 + Σ_k c_rk over its rows): then ĝ = 1 − Σ t / Σ t_0, the share of decoding time the drafting
        rounds save against no-draft rounds yielding as many tokens, where a plain mean of the rounds' g would be
        biased low (Jensen: two rounds each 35 % dearer than a no-draft one, promising one accepted draft and a tenth
        of one, save 13 % of the time together, while their g average 5 %). It is the weighted mean while the rounds
        add up to under `GAIN_WINDOW` no-draft rounds, then an exponential average over about that many; the first
        round of a batch size averages with the g its mean confidences promise (`saved_fraction`), counted as
        `PRIOR_ROUNDS`. One round's g swings by ±0.3 with its confidences, and a round drafts only while ĝ > 0, else
        as exploration: an average over five rounds stopped DFly on GSM8K prompts where it paid
        (`benchmarks/issue36/dcut_gain/`). A round that first read a backlog is priced at a usual round's drafting
        time (its catch-up is priced apart, `catch_up_seconds`). A round the drafter promised (the suffix drafter's
        matches) starts from its own g: its mean confidences say little of the rounds it promises (`make demo`: τ
        1.46 without averaging, 1.38 with)."""
        if drafting.reads_backlog:
            steps = len(drafting.probabilities)
            draft_seconds = self.first_step_seconds() + max(0, steps - 1) * self.step_seconds
        rows = len(depths)
        expected = rows + sum(float(c[:depth].sum()) for c, depth in zip(confidences, depths))
        rate = expected / (draft_seconds + self.widths[max(depths, default=0)])
        gain = 1 - (rows / self.widths[0]) / rate
        estimates = self.estimates
        previous, weight = estimates.drafting_gain.get(rows), estimates.gain_weight.get(rows, 0.0)
        if previous is None and self.promised_gain is None:
            previous = self.saved_fraction(self.first_step_seconds())
            weight = float(PRIOR_ROUNDS) if previous is not None else 0.0
        share = expected / rows
        weight += share
        estimates.drafting_gain[rows] = gain if previous is None else previous + (gain - previous) * share / weight
        estimates.gain_weight[rows] = min(weight, GAIN_WINDOW)

    def _record_drafting(self, calibrated: torch.Tensor, drafting: DraftRound) -> None:
        """Exponential averages of the per-position mean calibrated confidence, of the first drafting step's time and
        of the drafter's read ratio. A position the early exit did not reach keeps its estimate (the first time, that
        of the deepest drafted one), capped so that the estimates never grow with depth. A round that read a backlog
        (a new prompt, or tokens left by skipped rounds) measures the read ratio, not a usual first step's time."""
        drafted = calibrated.shape[1]
        mean = calibrated.mean(0)
        estimates = self.estimates
        if estimates.depth_confidence is None:
            estimates.depth_confidence = mean[-1].repeat(self.max_draft)
            estimates.depth_confidence[:drafted] = mean
        else:
            estimates.depth_confidence[:drafted] = 0.8 * estimates.depth_confidence[:drafted] + 0.2 * mean
        estimates.depth_confidence = estimates.depth_confidence.cummin(0).values
        first = drafting.first_step_seconds()
        if drafting.reads_backlog:  # the read ratio: over a usual first step when one is measured, else in all
            usual, seconds = (
                self.cost_model(self.rows, self.max_draft + 1),
                self.cost_model(self.rows, drafting.read_width),
            )
            if self.first_draft_seconds is not None and seconds > usual:
                ratio = max(0.0, first - self.first_draft_seconds) / (seconds - usual)
            else:
                ratio = first / seconds
            estimates.read_ratio = 0.5 * estimates.read_ratio + 0.5 * ratio
        else:
            self.first_draft_seconds = (
                first if self.first_draft_seconds is None else 0.8 * self.first_draft_seconds + 0.2 * first
            )

    def observe(self, drafting, depths, accepted, rows):
        observed = [
            (r, *observed_steps(depth, count)) for r, (depth, count) in enumerate(zip(depths, accepted)) if depth
        ]
        if not observed:
            return
        chosen = drafting.chosen_probabilities()
        self.calibrator.update(
            torch.cat([chosen[r, :reached] for r, reached, _ in observed]),
            torch.cat([torch.arange(reached) for _, reached, _ in observed]),
            torch.tensor([outcome for _, _, outcomes in observed for outcome in outcomes]),
            torch.cat([drafting.sources[r].repeat(reached) for r, reached, _ in observed]),
        )


POLICIES: dict[str, type[VerifyPolicy]] = {policy.schedule: policy for policy in (Constant, Heuristic, DCut)}


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
    return DCut(count, cost_model) if name == DCUT else POLICIES[name](count)


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
    drafting = DraftRound(
        temperatures,
        sampled=sampled,
        generators=generators,
        read_width=tokens.shape[1],
        reads_backlog=tokens.shape[1] > policy.max_draft + 1,  # after skipped rounds, or a new prompt
        keep_drafting_rule=lambda steps: policy.keep_drafting(steps, count),
    )
    draft_ids, logits = drafter.propose(
        state, hidden, tokens, count, drafting, keep_drafting=drafting.keep_drafting, new_lengths=new_lengths
    )
    drafting.seconds = time.perf_counter() - drafting.start
    return draft_ids, logits, drafting
