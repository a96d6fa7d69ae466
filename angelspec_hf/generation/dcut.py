"""D-cut (AngelSpec §4): verify only as deep as it pays off on this hardware.

Every drafted token gets a confidence, the prefix product of the draft probabilities up to it (an estimate of the
chance that the whole prefix is accepted), calibrated online against what verification actually accepts. The
drafted tokens of all requests are ranked together by confidence, and the verified set S is the prefix of that
ranking that maximises expected tokens per second of the round:

    S* = argmax_S  (R + Σ_{(r,k) ∈ S} c_rk) / (t_draft + t_verify(R, 1 + max_r n_r(S)))

R requests each keep their bonus token; n_r(S) is request r's verified depth; t_verify is the target's verify
forward latency profiled on this machine (`verify_cost.VerifyCostModel`). A single `generate()` call is the case
R = 1. Drafting rounds record the confidences (`draft_round.DraftRound`). Written here because no library ships
it: transformers' schedules (`constant`, `heuristic`, confidence threshold) set one depth per sequence without a
cost model.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


# The saving promised for a round of a drafter that reads for free and has a match (the suffix drafter's
# `promised_gain`, and the router's rounds of it): a round risks only its lookups, as D-cut's cut of its drafts
# verifies none whose calibrated confidence would not pay.
FREE_ROUND_GAIN = 0.01


class ConfidenceCalibrator:
    """Maps draft probabilities to acceptance. Per step, the rate at which a drafted token is accepted when every
    earlier one was (its conditional acceptance) is learned by bin of the step's draft probability, apart for a
    round's first step and its later ones, with exponential forgetting, starting from the identity (`prior_weight`
    pseudo-observations at the raw value itself); a prefix's confidence is the product of its steps' calibrated
    rates (`__call__`).

    §4 calibrates the raw prefix product instead; measured on GSM8K with the suffix drafter (8 prompts), that mixes
    what the product hides: a round's first draft follows the target's own token, often a correction where the
    context just left the text the drafter matched, and was accepted 45–60 % of the time at draft probabilities
    0.7–0.9, while a later step, continuing an accepted draft, was accepted 70–85 % of the time at the same
    probabilities. A prefix of eight drafts at 0.97 each has a raw product of 0.78, the bin in which first drafts of
    0.8 were accepted 64 % of the time; the rounds that verified seven or eight drafts accepted 1.1–1.3 of them.

    One map per source: a drafter whose rows are drafted by different members (the router) names each row's member
    (`DraftRound.sources`), since the same draft probability from an MTP head and from a suffix match is not accepted
    equally often; a single drafter is source 0."""

    # a round's first drafted token, and the ones after an accepted prefix: step k belongs to group min(k, last)
    STEP_GROUPS = ("first", "later")

    def __init__(self, num_bins: int = 10, prior_weight: float = 2.0, decay: float = 0.99):
        self.num_bins, self.prior_weight, self.decay = num_bins, prior_weight, decay
        shape = (1, len(self.STEP_GROUPS), num_bins)  # [sources, step groups, bins]
        self.tried = torch.zeros(shape, dtype=torch.float64)
        self.accepted = torch.zeros(shape, dtype=torch.float64)
        self._tables: tuple[list, list] | None = None  # the maps as nested lists, for `__call__`

    def _index(self, raw: torch.Tensor, steps: torch.Tensor, sources: torch.Tensor | None) -> tuple:
        """Each probability's (source, step group, bin), `steps` and `sources` broadcast to `raw`; maps for new
        sources start empty."""
        bins = (_unit(raw) * self.num_bins).long().clamp(max=self.num_bins - 1)
        groups = steps.long().clamp(max=len(self.STEP_GROUPS) - 1).expand_as(bins)
        sources = torch.zeros_like(bins) if sources is None else sources.long().expand_as(bins)
        self._grow(int(sources.max()) + 1 if sources.numel() else 0)
        return sources, groups, bins

    def _grow(self, num_sources: int) -> None:
        """Room for `num_sources` sources' maps (new ones empty)."""
        missing = num_sources - self.tried.shape[0]
        if missing > 0:
            self.tried = torch.cat([self.tried, self.tried.new_zeros(missing, *self.tried.shape[1:])])
            self.accepted = torch.cat([self.accepted, self.accepted.new_zeros(missing, *self.accepted.shape[1:])])
            self._tables = None

    def step_rate(self, raw: torch.Tensor, sources: torch.Tensor | None = None) -> torch.Tensor:
        """The calibrated conditional acceptance of the steps of drafts [..., steps] with draft probabilities `raw`
        (`sources` broadcastable to it, e.g. [rows, 1], names whose map each is read from)."""
        steps = torch.arange(raw.shape[-1]) if raw.dim() else torch.tensor(0)
        index, raw = self._index(raw, steps, sources), _unit(raw)
        return (self.accepted[index] + self.prior_weight * raw) / (self.tried[index] + self.prior_weight)

    def __call__(
        self, chosen: torch.Tensor, known: torch.Tensor | None = None, sources: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Calibrated prefix confidences c_k = Π_{j<k} a_j(q_j(x_j)) · a_k(m_k), [..., steps], non-increasing along
        the steps: `chosen` holds each step's q_j(x_j), `known` its m_k, known before x_k was drawn (`chosen`
        itself, the default, for greedy drafts; see `DraftRound`), a_k() the step rate of step k (`step_rate`).

        In plain floats over the maps read once per update: D-cut asks after every drafting step of a round, for a
        few rows of a few steps, where a dozen tensor operations cost more than the arithmetic."""
        shape = chosen.shape
        steps = shape[-1] if chosen.dim() else 1
        chosen_rows = _unit(chosen).reshape(-1, steps).tolist()
        known_rows = chosen_rows if known is None else _unit(known).expand(shape).reshape(-1, steps).tolist()
        if sources is None:
            source_rows = [[0] * steps] * len(chosen_rows)
        else:
            source_rows = sources.long().expand(shape).reshape(-1, steps).tolist()
            self._grow(max((max(row) for row in source_rows), default=-1) + 1)
        if self._tables is None:
            self._tables = (self.tried.tolist(), self.accepted.tolist())
        tried, accepted = self._tables
        top, prior, last_group = self.num_bins - 1, self.prior_weight, len(self.STEP_GROUPS) - 1

        def rate(value: float, source: int, group: int) -> float:
            b = min(int(value * self.num_bins), top)
            return (accepted[source][group][b] + prior * value) / (tried[source][group][b] + prior)

        confidences = []
        for chosen_row, known_row, source_row in zip(chosen_rows, known_rows, source_rows):
            before, lowest, row = 1.0, 1.0, []
            for step, (value, known_value, source) in enumerate(zip(chosen_row, known_row, source_row)):
                group = min(step, last_group)
                lowest = min(lowest, before * rate(known_value, source, group))
                row.append(lowest)
                before *= rate(value, source, group)
            confidences.append(row)
        return torch.tensor(confidences, dtype=torch.float64).reshape(shape)

    def update(
        self, raw: torch.Tensor, steps: torch.Tensor, accepted: torch.Tensor, sources: torch.Tensor | None = None
    ) -> None:
        """Record verified steps whose earlier steps were all accepted (`observed_steps` says which): their draft
        probabilities `raw`, their step in the round (0 for the first), whether each was accepted, and (when given)
        whose drafts they were, all alike in shape."""
        index = self._index(raw.flatten(), steps.flatten(), None if sources is None else sources.flatten())
        self.tried *= self.decay
        self.accepted *= self.decay
        self._tables = None
        self.tried.index_put_(index, torch.ones_like(index[2], dtype=torch.float64), accumulate=True)
        self.accepted.index_put_(index, accepted.flatten().double(), accumulate=True)

    def table(self, source: int = 0) -> list[dict]:
        """The calibration of one source: per step group and bin of a step's draft probability, how often such steps
        were verified after an accepted prefix (decayed) and the observed rate at which they were accepted."""
        tried, accepted = self.tried[source], self.accepted[source]
        return [
            {
                "step": name,
                "draft_probability": [b / self.num_bins, (b + 1) / self.num_bins],
                "weight": float(tried[g, b]),
                "accepted_rate": float(accepted[g, b] / tried[g, b]) if tried[g, b] > 0 else None,
            }
            for g, name in enumerate(self.STEP_GROUPS)
            for b in range(self.num_bins)
        ]

    def report(self) -> dict:
        """For a benchmark report: `calibration`, the table of source 0, and with several sources (the router's
        members) `calibration_by_source`, every source's."""
        report = {"calibration": self.table()}
        if self.tried.shape[0] > 1:
            report["calibration_by_source"] = [self.table(source) for source in range(self.tried.shape[0])]
        return report


def observed_steps(depth: int, accepted: int) -> tuple[int, list[bool]]:
    """What a row that verified `depth` drafts and had `accepted` of them accepted tells of each step's conditional
    acceptance: the steps reached with an accepted prefix (the first `accepted + 1`, at most `depth`) and whether
    each was accepted; the steps after the first rejected one say nothing."""
    reached = min(depth, accepted + 1)
    return reached, [step < accepted for step in range(reached)]


def _unit(raw: torch.Tensor) -> torch.Tensor:
    """Probabilities as float64 in [0, 1], a non-finite one read as 0."""
    return raw.double().nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(0, 1)


def prefix_confidence(draft_probabilities: torch.Tensor) -> torch.Tensor:
    """c_k = Π_{j ≤ k} q_j(x_j): [..., K] probabilities of the drafted tokens to their prefix products."""
    return draft_probabilities.double().cumprod(dim=-1)


def dcut_depths(
    confidences: Sequence[torch.Tensor],
    verify_seconds: Callable[[int, int], float],
    draft_seconds: float = 0.0,
    sampled: Sequence[bool] | None = None,
) -> list[int]:
    """How many drafted tokens of each request to verify: the best prefix of the global confidence ranking.

    `confidences[r]` holds request r's calibrated, non-increasing confidences; `verify_seconds(rows, width)` is the
    cost model (each row padded to the widest). Ties rank the earlier position first, so every request's selected
    tokens form a prefix of its draft.

    Rows whose drafts were sampled (`sampled[r]`) are decided position by position: position k joins the verified
    set only if the best cut over what is known up to k (every row's confidences up to k; a greedy row's in full)
    verifies it, and then stays in it. Whether x_k is verified thus never depends on x_k or on anything drafted
    after it, as speculative rejection sampling requires for the output to keep the target's distribution.
    """
    rows = len(confidences)
    sampled = list(sampled) if sampled is not None else [False] * rows
    committed = [0] * rows
    if any(sampled):
        open_rows = {r for r in range(rows) if sampled[r] and len(confidences[r])}
        for k in range(1, max((len(confidences[r]) for r in open_rows), default=0) + 1):
            view = [
                c if not sampled[r] else c[: k if r in open_rows else committed[r]] for r, c in enumerate(confidences)
            ]
            cut = _best_cut(view, verify_seconds, draft_seconds, committed)
            for r in sorted(open_rows):
                if cut[r] >= k:
                    committed[r] = k
                if cut[r] < k or k == len(confidences[r]):
                    open_rows.discard(r)
            if not open_rows:
                break
        confidences = [c[: committed[r]] if sampled[r] else c for r, c in enumerate(confidences)]
    return _best_cut(confidences, verify_seconds, draft_seconds, committed)


def _best_cut(confidences, verify_seconds, draft_seconds: float, committed: Sequence[int]) -> list[int]:
    """The best prefix of the confidence ranking, every row verifying at least its `committed` leading tokens."""
    rows = len(confidences)
    ranking = sorted(
        (
            (float(value), position, request)
            for request, values in enumerate(confidences)
            for position, value in enumerate(values.tolist())
            if position >= committed[request]
        ),
        key=lambda item: (-item[0], item[1]),
    )
    depths = list(committed)
    expected = rows + sum(float(values[: committed[r]].sum()) for r, values in enumerate(confidences))
    width = 1 + max(depths, default=0)
    best_rate, best_count = expected / (draft_seconds + verify_seconds(rows, width)), 0
    for count, (value, _, request) in enumerate(ranking, start=1):
        depths[request] += 1
        expected += value
        width = max(width, 1 + depths[request])
        rate = expected / (draft_seconds + verify_seconds(rows, width))
        if rate > best_rate:
            best_rate, best_count = rate, count
    chosen = list(committed)
    for _, _, request in ranking[:best_count]:
        chosen[request] += 1
    return chosen


def worth_drafting_further(
    confidences: Sequence[torch.Tensor],
    verify_seconds: Callable[[int, int], float],
    max_draft: int,
    draft_seconds: float,
    step_seconds: float,
    top_confidence: float = 1.0,
) -> bool:
    """Early exit of sequential drafting (MTP depths, DFly's AR head, suffix matches), for R rows drafting in lockstep.

    `confidences[r]` are row r's calibrated prefix confidences so far (k each). With padded verification the best
    cut verifies everything drafted up to some width, so the best rate achievable now is
    max_w (R + Σ_r Σ_{j<w} c_rj) / (t_draft + t_v(R, 1 + w)). Each row's further steps are forecast to keep its
    last step's calibrated rate, c_r,k+i = c_rk · ρ_r^i with ρ_r = c_rk / c_r,k-1 (the step rate a(q_k) of a greedy
    row; 1 after a single step, and `top_confidence` for the first one); drafting stops when no m more steps,
    costing m further step times, beat the rate already achievable. Only what was drafted up to k is read.

    Forecasting each step at the last one's confidence instead (ρ = 1, a bound: confidences never grow along a
    draft) kept the suffix drafter drafting to eight tokens where the cut verified three or four; replayed on the
    held-out responses (`benchmarks/issue35/dcut_replay/replay.py`) the forecast drafted 2.3-3.5 tokens a round
    instead of 3.5-5.0 and was 2.5-4.3 % faster.
    """
    rows = len(confidences)
    drafted = len(confidences[0]) if rows else 0
    if rows == 0 or drafted >= max_draft:
        return False
    values = [c.tolist() for c in confidences]
    expected = [float(rows)]  # by verified width
    for step in range(drafted):
        expected.append(expected[-1] + sum(row[step] for row in values))
    best = max(expected[w] / (draft_seconds + verify_seconds(rows, 1 + w)) for w in range(drafted + 1))
    if drafted:
        last = [row[-1] for row in values]
        ratio = [row[-1] / row[-2] if drafted > 1 and row[-2] > 0 else 1.0 for row in values]
    else:
        last, ratio = [top_confidence] * rows, [1.0] * rows
    total = expected[-1]
    for more in range(1, max_draft - drafted + 1):
        total += sum(value * rate**more for value, rate in zip(last, ratio))
        if total / (draft_seconds + more * step_seconds + verify_seconds(rows, 1 + drafted + more)) > best:
            return True
    return False
