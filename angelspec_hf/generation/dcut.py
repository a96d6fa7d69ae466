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
    """Maps a raw confidence (prefix product of draft probabilities) to the observed rate at which prefixes of that
    confidence are accepted: acceptance counts per confidence bin with exponential forgetting, so the map follows
    drift, starting from the identity (`prior_weight` pseudo-observations at the raw value itself).

    One map per source: a drafter whose rows are drafted by different members (the router) names each row's member
    (`DraftRound.sources`), since the same raw confidence from an MTP head and from a suffix match is not accepted
    equally often; a single drafter is source 0."""

    def __init__(self, num_bins: int = 10, prior_weight: float = 2.0, decay: float = 0.99):
        self.num_bins, self.prior_weight, self.decay = num_bins, prior_weight, decay
        self.tried = torch.zeros(1, num_bins, dtype=torch.float64)  # [sources, bins]
        self.accepted = torch.zeros(1, num_bins, dtype=torch.float64)

    def _index(self, raw: torch.Tensor, sources: torch.Tensor | None) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Each confidence's (source, bin), `sources` broadcast to `raw`; maps for new sources start empty."""
        bins = (_unit(raw) * self.num_bins).long().clamp(max=self.num_bins - 1)
        sources = torch.zeros_like(bins) if sources is None else sources.long().expand_as(bins)
        missing = int(sources.max()) + 1 - self.tried.shape[0] if sources.numel() else 0
        if missing > 0:
            self.tried = torch.cat([self.tried, self.tried.new_zeros(missing, self.num_bins)])
            self.accepted = torch.cat([self.accepted, self.accepted.new_zeros(missing, self.num_bins)])
        return sources, bins

    def __call__(self, raw: torch.Tensor, sources: torch.Tensor | None = None) -> torch.Tensor:
        """Calibrated confidences, non-increasing along the last dimension (a longer prefix is never likelier);
        `sources` (broadcastable to `raw`, e.g. [rows, 1]) names whose map each confidence is read from."""
        (sources, bins), raw = self._index(raw, sources), _unit(raw)
        rate = (self.accepted[sources, bins] + self.prior_weight * raw) / (
            self.tried[sources, bins] + self.prior_weight
        )
        return rate.cummin(dim=-1).values if raw.dim() else rate

    def update(self, raw: torch.Tensor, accepted: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """Record verified draft tokens: `raw` confidences, whether each one's whole prefix was accepted, and (when
        given, like `raw`) whose drafts they were."""
        sources, bins = self._index(raw.flatten(), None if sources is None else sources.flatten())
        self.tried *= self.decay
        self.accepted *= self.decay
        self.tried.index_put_((sources, bins), torch.ones_like(bins, dtype=torch.float64), accumulate=True)
        self.accepted.index_put_((sources, bins), accepted.flatten().double(), accumulate=True)

    def table(self, source: int = 0) -> list[dict]:
        """The calibration of one source: per raw-confidence bin, how often it was tried and the observed
        acceptance rate."""
        tried, accepted = self.tried[source], self.accepted[source]
        return [
            {
                "raw_confidence": [b / self.num_bins, (b + 1) / self.num_bins],
                "weight": float(tried[b]),
                "accepted_rate": float(accepted[b] / tried[b]) if tried[b] > 0 else None,
            }
            for b in range(self.num_bins)
        ]

    def report(self) -> dict:
        """For a benchmark report: `calibration`, the table of source 0, and with several sources (the router's
        members) `calibration_by_source`, every source's."""
        report = {"calibration": self.table()}
        if self.tried.shape[0] > 1:
            report["calibration_by_source"] = [self.table(source) for source in range(self.tried.shape[0])]
        return report


def _unit(raw: torch.Tensor) -> torch.Tensor:
    """Confidences as float64 in [0, 1], a non-finite one read as 0."""
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
    """Early exit of sequential drafting (MTP depths, DFly's AR head), for R rows drafting in lockstep.

    `confidences[r]` are row r's calibrated prefix confidences so far (k each). With padded verification the best
    cut verifies everything drafted up to some width, so the best rate achievable now is
    max_w (R + Σ_r Σ_{j<w} c_rj) / (t_draft + t_verify(R, 1 + w)). Drafting m more tokens per row adds at most
    m·Σ_r c_rk expected tokens (confidences never grow along a draft; `top_confidence` when nothing is drafted yet)
    and costs m further steps; drafting stops when no m can beat the rate already achievable.
    """
    rows = len(confidences)
    drafted = len(confidences[0]) if rows else 0
    if rows == 0 or drafted >= max_draft:
        return False
    columns = torch.stack([c.double() for c in confidences]) if drafted else torch.zeros(rows, 0, dtype=torch.float64)
    expected = rows + torch.cat([torch.zeros(1, dtype=torch.float64), columns.sum(0).cumsum(0)])  # by width
    best = max(float(expected[w]) / (draft_seconds + verify_seconds(rows, 1 + w)) for w in range(drafted + 1))
    last = float(columns[:, -1].sum()) if drafted else rows * top_confidence
    for more in range(1, max_draft - drafted + 1):
        rate = (float(expected[-1]) + more * last) / (
            draft_seconds + more * step_seconds + verify_seconds(rows, 1 + drafted + more)
        )
        if rate > best:
            return True
    return False
