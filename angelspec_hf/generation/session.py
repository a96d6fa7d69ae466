"""Decoding sessions: what decoding with a drafter decides and remembers, kept apart from the drafter.

A drafter is a model: it drafts, binds to its target, saves and loads. What a decoding run decides (the verify
policy: how many tokens to draft and to verify; a router's routing policy: which member drafts each request; the
verify-cost profile both price with) and what it measures (the speculation statistics) is a `DecodingSession`,
which the generation code makes for each run: `generate()`'s candidate generator, the batched engine, and through
them the benchmarks. What decoding learns on this machine outlives a run (D-cut's estimates, the routing records):
it is kept per drafter object in a `DrafterMemory`, held in a weak mapping (it goes with the drafter), so that each
run of the same drafter starts from what the earlier ones learned, as a served drafter would.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

from ..metrics import SpeculationStats
from .policies import DrafterEstimates, RowState, VerifyPolicy, draft_round, profiled_rows, resolve_policy
from .routing import RoutingPolicy
from .verify_cost import CorrectedCost, load_cost_model


@dataclass
class DrafterMemory:
    """What decoding learned about one drafter, across runs."""

    estimates: DrafterEstimates | None = None  # D-cut's: calibration, confidence by depth, read cost, ĝ
    routing: RoutingPolicy | None = None  # a router's routing policy, with its records
    stats: SpeculationStats | None = None  # the last decoding call's


_MEMORIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def memory_of(drafter) -> DrafterMemory:
    """The drafter's memory (empty the first time it decodes)."""
    memory = _MEMORIES.get(drafter)
    if memory is None:
        memory = _MEMORIES[drafter] = DrafterMemory()
    return memory


def routing_of(router) -> RoutingPolicy:
    """The routing policy decoding keeps for `router` (a `RouterDrafter`), with what it has learned so far."""
    memory = memory_of(router)
    if memory.routing is None:
        memory.routing = RoutingPolicy(router)
    return memory.routing


def forget_served_requests(drafter) -> None:
    """Start the drafter over as loaded: what serving taught it (a suffix index's recorded outputs) and a router's
    routing records are dropped; D-cut's estimates of this machine are kept. Each measured benchmark run starts
    here, so no run drafts an earlier run's answers to the same prompts."""
    drafter.forget_served_requests()
    memory_of(drafter).routing = None


class DecodingSession:
    """One decoding run of `drafter` on `target`, for up to `max_rows` rows at a time: its verify policy (a
    `VerifyPolicy`, a label, or None for the drafter's generation config), a router's routing policy, and the run's
    statistics (`stats`, also the drafter's `speculation_stats` until its next run). The loops ask it, in a round's
    order: `draft_count`, `draft_round`, `depths`, `observe`."""

    def __init__(self, target, drafter, policy: VerifyPolicy | str | None = None, cost_model=None, max_rows: int = 1):
        self.drafter = drafter
        self.policy = resolve_policy(policy, drafter, cost_model)
        self.memory = memory = memory_of(drafter)
        self.policy.start(target, drafter, memory, max_rows=max_rows, promise_counts_catch_up=drafter.routes_members)
        self.routing = None
        self.cost = self.policy.cost_model  # D-cut's, corrected by this run's verify forwards (`observe_forward`)
        if drafter.routes_members:  # priced by the verify policy's cost, else by this machine's profile, corrected
            self.routing = routing_of(drafter)
            if self.cost is None:
                self.cost = CorrectedCost.of(cost_model or load_cost_model(target, rows=profiled_rows(max_rows)))
            self.routing.cost_model = self.cost
        self.stats = memory.stats = SpeculationStats()

    def report(self, stats: SpeculationStats) -> None:
        """Replace the run's statistics (the batched path pools its requests' own)."""
        self.stats = self.memory.stats = stats

    @property
    def max_draft(self) -> int:
        return self.policy.max_draft

    def new_row(self) -> RowState:
        return self.policy.new_row()

    def draft_count(
        self,
        state,
        rows: Sequence[RowState],
        budget: int,
        pending: list[list[int]],
        tokens_left: list[int] | None = None,
    ) -> int:
        """Most tokens to draft this round (0: skip it) for `rows`, whose `pending[r]` verified tokens the drafter
        has not read, `budget` the most any row may still add; a router's routing policy first chooses each row's
        member (a catch-up spread over `tokens_left[r]`, row r's own tokens left; `budget` for every row when not
        given) and promises the round's saving."""
        if self.routing:
            promised = self.routing.plan(state, pending, tokens_left=tokens_left or [budget] * len(rows))
        else:
            promised = self.drafter.promised_gain(state, pending)
        backlog = max((len(tokens) for tokens in pending), default=0)
        return self.policy.draft_count(rows, budget, backlog, promised_gain=promised)

    def draft_round(self, state, rows: Sequence[RowState], hidden, tokens, count: int, **options):
        """The drafting round (`policies.draft_round`) with this session's drafter and policy."""
        return draft_round(self.drafter, state, self.policy, rows, hidden, tokens, count, **options)

    def depths(self, drafting, caps: list[int], rows: Sequence[RowState]) -> list[int]:
        return self.policy.depths(drafting, caps, rows, drafting.seconds)

    def observe_forward(self, rows: int, width: int, seconds: float) -> None:
        """A verify forward of `rows` rows, `width` tokens each, took `seconds`: the cost model learns it."""
        if self.cost is not None:
            self.cost.observe(rows, width, seconds)

    def observe(self, state, drafting, depths: list[int], accepted: list[int], rows: Sequence[RowState]) -> None:
        """After verification: row r verified `depths[r]` drafts and accepted `accepted[r]` of them."""
        self.policy.observe(drafting, depths, accepted, rows)
        if self.routing:
            self.routing.record_acceptance(state, depths, accepted)
