"""Routing: which member of a router drafts each request, round by round (a policy beside the verify policy).

No single drafter wins everywhere (AngelSpec): an MTP head for open chat, block diffusion (DFly) for code and math,
suffix matching where the output repeats its input. A `RouterDrafter` holds such members; `RoutingPolicy` drafts
every request, each round, with the member that promises it the most tokens per second,

    score(r, m) = d_m (1 + a_rm) / (t_m + E[t_v(R, 1 + n_rm)] + t_o),

a_rm being the tokens request r accepted per round when member m last drafted it and n_rm the drafts it had
verified, whose law the policy keeps (the mean of the request's rounds with the member, then a running average;
its prior is the member's record over requests, counted as a few rounds), t_m the member's drafting time plus its
catch-up on request r, t_v the profiled verify cost of the batch of R requests, t_o the measured rest of a round
(`round_overhead`) and d_m the share of its promised tokens member m's rounds delivered (`delivery`). The
expectation is over the recorded law of n, not t_v at its mean: a cut verifies none on some rounds and many on
others, and t_v is neither linear nor, on some machines, monotone. A member not chosen
does not run: the verified tokens wait for it and it reads them all when next chosen, so its catch-up (its measured
time per token read beyond a usual round's, times the tokens waiting) is paid by the round that switches to it; a
member that reads for free (suffix) has none. Reading is linear in the tokens read, so a member that drafts again
at all in a request pays for reading every token it skipped, whenever it switches: the catch-up is spread over the
rounds the request has left (its own tokens left over the member's 1 + a_rm, as the verify policy spreads a
single drafter's). Charged to the switching round alone, it grew with every round another member drafted and kept the
MTP member out of the rest of a long request once the suffix member had drafted a while. The policy's promise to
the verify policy counts it, so the verify policy adds no catch-up price of its own. A member that reads for free
drafts every round where its match reaches `free_match_first` tokens, before any score. A request tries every member
once, and again each `explore_tokens` verified tokens a member has not drafted it, so no estimate goes stale (a
request admitted while another's try of a member is pending does not try it, and goes by that try's verdict); `plan` tells the verify
policy what the next round promises, optimistic for such a try. A try costs the member's catch-up
on the request's whole backlog (a long prompt), so a try waits until that costs a small share of the request's
decoding so far (`needs_try`); it displaces the member that would have drafted the round, so a member tried before
then waits for an idle round, where no other member promises a gain, at most `explore_tokens` verified tokens
(`choice`); and tries back off across requests: a member whose try loses (the rate of its try round below the
best other member's score, or below decoding without drafts) sits out the tries of the next `b` new requests, b
doubling with each loss up to `MAX_TRY_BACKOFF` and back to 0 on a win; within a request, its re-try interval
doubles with each loss there. Which member drafts a round reads only earlier rounds, and each
member's drafts keep their own draft law, so the output keeps the target's (rejection sampling).

The records a policy learns (per member, across requests) outlive a decoding run: the decoding session keeps one
policy per router (`session.py`). Per request, the router's draft state holds what each member still has to read
and how it did (`RouterDraftState`). Written by hand: no library routes between speculative drafters.
"""

from __future__ import annotations

import time

from .dcut import FREE_ROUND_GAIN
from .verify_cost import VerifyCost


PRIOR_ACCEPTED = 1.0  # tokens per round a member is credited with before its first round is averaged in
PRIOR_VERIFIED = {1: 1.0}  # and the law of its drafts verified per round: one
NO_DRAFTS = {0: 1.0}  # the law of drafts verified per round when nothing is drafted
UNTRIED_GAIN = 0.5  # the saving promised for a round that tries a member never tried before
AVERAGE = 0.3  # weight of the newest round in the running averages of a member's drafting and reading times
# Acceptance records are means over their first rounds, then running averages with at least this weight on the newest
# round: a request's (its prior, the member's record over requests, counted as REQUEST_PRIOR_ROUNDS rounds), and a
# member's or an outlook bucket's, pooled over requests (the prior counted as one round). A short running average
# (weight 0.3 before) let two unlucky rounds sink a member's estimate below decoding without drafts, after which it
# never drafted again and the estimate never recovered.
REQUEST_AVERAGE = 0.1
REQUEST_PRIOR_ROUNDS = 4
BUCKET_AVERAGE = 0.05
# A member's delivery (what its rounds delivered of what they promised) starts at 1, counted as this many rounds: from
# its first chosen round alone (one draft rejected after a lucky try) the shipped MTP member's came out at 0.33 on
# Spec-Bench QA, its scores fell below decoding without drafts, and it never drafted again to correct it.
DELIVERY_PRIOR_ROUNDS = 8
MAX_TRY_BACKOFF = 32  # most new requests a member that keeps losing its tries sits out between two tries
TRY_SHARE = 0.05  # most of a request's decoding time so far that a try's catch-up (reading its backlog) may cost


def _average(old: float | None, new: float, first: float | None = None, weight: float = AVERAGE) -> float:
    """Running average (`weight` on the newest); the first observation is averaged with `first` (a prior) when one
    is given."""
    if old is None:
        old = first
    return new if old is None else (1 - weight) * old + weight * new


def _record_weight(rounds: int, floor: float, prior_rounds: int = 1) -> float:
    """The newest round's weight in an acceptance record after `rounds` rounds: the mean of the rounds and the prior
    (counted as `prior_rounds` rounds), then a running average with at least `floor` on the newest."""
    return max(floor, 1 / (rounds + prior_rounds))


def _average_law(
    old: dict[int, float] | None, new: int, first: dict[int, float] | None = None, weight: float = AVERAGE
) -> dict[int, float]:
    """The running average of a count's law ({count: probability}), as `_average` of its indicator."""
    law = {count: (1 - weight) * p for count, p in (old or first or {}).items()}
    law[int(new)] = law.get(int(new), 0.0) + (weight if (old or first) else 1.0)
    return law


class RoutingPolicy:
    """Chooses each request's member of `router` (a `RouterDrafter`) every round and learns from what the target
    accepted (module docstring); `cost_model` is the verify-cost profile the session gives it (None: one unit per
    verified token). The `state` its methods take is the router's `RouterDraftState`, and a `row` one of its rows."""

    def __init__(self, router, cost_model: VerifyCost | None = None):
        self.router = router
        self.cost_model = cost_model
        count = len(router.members)
        self.member_seconds: list[float | None] = [None] * count  # t_m of a usual round
        self.member_read_seconds: list[float | None] = [None] * count  # per token read beyond a usual round
        self.member_accepted: list[float | None] = [None] * count  # a_m over requests
        self.member_verified: list[dict[int, float] | None] = [None] * count
        self.member_rounds = [0] * count  # rounds averaged into a_m
        # Tokens per round (1 + a) each member promised when chosen and delivered, averaged over its rounds.
        self.member_promised: list[float | None] = [None] * count
        self.member_delivered: list[float | None] = [None] * count
        self.member_promises = [0] * count  # rounds averaged into them
        self.round_overhead: float | None = None  # a drafting round's seconds beyond drafting and the verify forward
        # For members with an outlook: (accepted, law of verified) per round, by outlook bucket.
        self.bucket_record: list[dict[int, tuple[float, dict[int, float]]]] = [{} for _ in range(count)]
        self.bucket_rounds: list[dict[int, int]] = [{} for _ in range(count)]  # rounds averaged into each record
        self.try_backoff = [0] * count  # new requests a member sits out after a lost try (doubling)
        self.try_wait = [0] * count  # new requests still to pass before the member's next try

    def score(self, row, m: int, bucket: int | None = None, pending: int = 0, rows: int = 1) -> float:
        """Expected tokens per second of a round drafted by member m for this request (module docstring), its
        catch-up on the tokens waiting for it (`pending` more verified since the router last drafted) included, in
        a batch of `rows` requests; for a member with an outlook, a_m and n_m are its record at this outlook's
        bucket."""
        accepted, verified = self.record(row, m, bucket)
        catch_up = self.catch_up_seconds_of(m, len(row.members[m].tokens) + pending) / self.rounds_left(row, accepted)
        accepted = (1 + accepted) * self.delivery(m) - 1
        return self._rate(accepted, verified, (self.member_seconds[m] or 0.0) + catch_up, rows)

    @staticmethod
    def rounds_left(row, accepted: float) -> float:
        """The rounds request `row` has left to spread a catch-up over when its member accepts `accepted` drafts per
        round: its `tokens_left` over 1 + a (at least one; one when unknown)."""
        if row.tokens_left is None:
            return 1.0
        return max(1.0, row.tokens_left / (1 + accepted))

    def record(self, row, m: int, bucket: int | None = None) -> tuple[float, dict[int, float]]:
        """Member m's record on this request, (a_rm, the law of n_rm); for a member with an outlook, its record at
        this outlook's bucket."""
        if bucket is not None:
            return self.bucket_record[m].get(bucket, (PRIOR_ACCEPTED, PRIOR_VERIFIED))
        own = row.members[m]
        accepted = own.accepted if own.accepted is not None else self.member_accepted[m]
        verified = own.verified if own.verified is not None else self.member_verified[m]
        return accepted or 0.0, verified or NO_DRAFTS

    def delivery(self, m: int) -> float:
        """What member m's rounds delivered of the tokens they promised (1 + a_rm when chosen). A request's record
        changes only on the rounds its member drafts, and the router picks a member when its record is high, so a
        record promises more than its next round delivers (a winner's curse: over 8 math-reasoning prompts the
        shipped DFly member's rounds delivered 0.88 of their promise, the suffix member's 1.13); scores are scaled
        by it. It starts at 1, counted as `DELIVERY_PRIOR_ROUNDS` rounds."""
        if self.member_promised[m] is None:
            return 1.0
        return self.member_delivered[m] / self.member_promised[m]

    def usual_width(self, m: int) -> int:
        """Verified tokens member m reads in a usual round: its drafts per round and the bonus token."""
        return int(self.router.members[m].generation_config.num_assistant_tokens) + 1

    def catch_up_seconds_of(self, m: int, waiting: int) -> float:
        """Member m's time to read `waiting` verified tokens beyond a usual round's (none for a member that reads
        for free; unknown until it has caught up once, counted as none then: its first try is exploration)."""
        usual = self.usual_width(m)
        if self.router.members[m].reads_for_free or waiting <= usual:
            return 0.0
        return (waiting - usual) * (self.member_read_seconds[m] or 0.0)

    def _rate(self, accepted: float, verified: dict[int, float], seconds: float, rows: int = 1) -> float:
        """(1 + a) / (t + E[t_v(R, 1 + n)] + t_o): a request's tokens per second in rounds of R = `rows` requests
        that draft for `seconds` and verify n drafts per request (`verified`: n's law), a of them accepted (t_v the
        profiled verify cost of the batch, whose widening costs more where the verify forward is compute-bound;
        t_o the measured `round_overhead`; without a profile, one unit per token and no overhead)."""
        model = self.cost_model
        if model is None:
            return (1 + accepted) / (seconds + sum(weight * (1 + n) for n, weight in verified.items()))
        verify = sum(weight * model(rows, 1 + n) for n, weight in verified.items())
        return (1 + accepted) / (seconds + verify + (self.round_overhead or 0.0))

    def admit(self, state, r: int) -> None:
        """Decide, once per request, which members it tries: those whose backoff across requests has run out and
        that no other request in the batch is still to try (a try in flight is judged before the next one starts,
        so a batch of new requests pays one try per member, not one per request)."""
        row = state.rows[r]
        if row.admitted:
            return
        row.admitted = True
        for m, own in enumerate(row.members):
            in_flight = any(
                other.admitted and other.members[m].tries and other.members[m].accepted is None
                for other in state.rows
                if other is not row
            )
            own.tries = self.try_wait[m] == 0 and not in_flight
            self.try_wait[m] = max(0, self.try_wait[m] - 1)
            own.explore_every = self.router.config.explore_tokens

    def needs_try(self, row, m: int, pending: int = 0, rows: int = 1) -> bool:
        """Whether member m (one without an outlook) is due a try on this request: one the request tries (`admit`)
        that never drafted it, or not for its re-try interval (`pending` tokens verified since the router last
        drafted), once the try is affordable. A try first reads the member's whole backlog (the prompt, on a
        first try), so it waits until that catch-up costs at most `TRY_SHARE` of the time the request has decoded
        so far, counted at t_v(R, 1) per token: soon after a short prompt, late or never after a long one (a
        RAG document), where the catch-up alone would cost more than the try could win back."""
        own = row.members[m]
        if not own.tries or not (own.accepted is None or own.since + pending >= own.explore_every):
            return False
        if self.cost_model is None:
            return True
        decoded = row.read - (row.prompt or 0) + pending
        budget = TRY_SHARE * decoded * self.cost_model(rows, 1)
        return self.catch_up_seconds_of(m, len(own.tokens) + pending) <= budget

    def _judge_try(self, state, r: int, m: int, verified: int, accepted: int) -> None:
        """After a round that tried member m on request r and had `accepted` of `verified` drafts accepted: a win
        (that round's rate above every other member's score and above decoding without drafts) clears its backoff;
        a loss doubles it, across requests and on this request."""
        row = state.rows[r]
        looks = self.router.outlooks(state, r)
        rows = len(state.rows)
        others = [self.score(row, o, looks[o], rows=rows) for o in range(len(self.router.members)) if o != m]
        rate = self._rate(accepted, {verified: 1.0}, self.member_seconds[m] or 0.0, rows)
        if rate >= max(others, default=0.0) and rate > self._rate(0.0, NO_DRAFTS, 0.0, rows):
            self.try_backoff[m] = self.try_wait[m] = 0
            return
        self.try_backoff[m] = min(MAX_TRY_BACKOFF, max(1, 2 * self.try_backoff[m]))
        self.try_wait[m] = self.try_backoff[m]
        row.members[m].explore_every *= 2

    def choice(self, state, r: int, pending: list[int] = ()) -> tuple[int, int | None, bool]:
        """Request r's member for this round, its outlook bucket, and whether it is a try: a member that reads for
        free with a match of at least `free_match_first` tokens (the router's config); else a member without an
        outlook due a try (the cheapest first), else the best score; where no score beats decoding without drafts,
        a member that reads for free and has a match (the suffix member: `plan` promises at least FREE_ROUND_GAIN
        for it, so its cut decides).

        The first rule, because the scores judged the suffix member's rounds by its bucket's mean and another
        member's by the request's: on 6 GSM8K prompts the router drafted with MTP on half its rounds, where at
        matches of 2–7 tokens MTP accepted less a round than the suffix member (0.81 against 0.98, 1.06 against
        1.21), and ended with the suffix member's τ at a costlier round (8 prompts a domain, idle, one run: the
        router at or above the router without it on seven of the suite's eight domains, docs/experiments.md).

        A try displaces the member that would have drafted the round, so a due try of a member with a record (one
        tried before, on any request) waits for an idle round, one where no other member's score beats decoding
        without drafts and no free reader has a match (a suffix round with a long match is worth more than a try
        that usually loses), but at most `explore_tokens` verified tokens; a round of the first rule is the free
        reader's however long a try has waited."""
        row, looks = state.rows[r], self.router.outlooks(state, r, pending)
        self.admit(state, r)
        first = self.router.config.free_match_first
        free = [f for f, member in enumerate(self.router.members) if member.reads_for_free and looks[f]]
        if first and any(looks[f] >= first.bit_length() for f in free):
            f = max(free, key=lambda f: looks[f])
            return f, looks[f], False
        rows = len(state.rows)
        due = [m for m, look in enumerate(looks) if look is None and self.needs_try(row, m, len(pending), rows)]
        scores = [self.score(row, m, looks[m], len(pending), rows) for m in range(len(self.router.members))]
        plain = self._rate(0.0, NO_DRAFTS, 0.0, rows)
        if due:
            now = row.read + len(pending)
            best = max((score for m, score in enumerate(scores) if m not in due), default=0.0)
            idle = best <= plain and not free
            for m in due:
                if row.members[m].due_since is None:
                    row.members[m].due_since = now
            ready = [
                m
                for m in due
                if idle
                or self.member_accepted[m] is None
                or now - row.members[m].due_since >= self.router.config.explore_tokens
            ]
            if ready:
                m = min(ready, key=lambda m: self.member_seconds[m] or 0.0)
                return m, None, True
        m = max(range(len(self.router.members)), key=scores.__getitem__)
        if scores[m] <= plain and free:
            m = max(free, key=scores.__getitem__)
        return m, looks[m], False

    def plan(
        self, state, pending: list[list[int]] | None = None, tokens_left: list[int] | None = None
    ) -> float | None:
        """Choose each request's member for the coming round (`RouterRow.plan`, which the router's `propose`
        drafts with) and return what the round promises: the mean over requests of g = 1 − r_0 / score(r, m_r),
        r_0 = 1 / t_v(1) the rate without drafts and m_r the request's choice, what drafting each request with it
        saves; UNTRIED_GAIN for a request due a try (so the round drafts and the member is tried), and at least
        FREE_ROUND_GAIN for one whose member reads for free and has a match. Such a member's record is an average
        over its outlook bucket, while D-cut cuts each round by the calibrated confidence of its own drafts,
        verifying none where they would not pay: the cut, not the record, decides (the suffix drafter alone drafts
        so, and beat the router that skipped by its records on six of eight Spec-Bench-style domains).
        `pending[r]`: tokens request r verified since the router last drafted; `tokens_left[r]`: most tokens
        request r may still decode (its catch-ups are spread over them). The promise is None without a profile."""
        if not state.rows:
            return None
        for row, left in zip(state.rows, tokens_left or [None] * len(state.rows)):
            row.tokens_left = left
        self._learn_drafting_times(state)
        if self.cost_model is not None:
            self._time_round(state)
        plain = self._rate(0.0, NO_DRAFTS, 0.0, len(state.rows))  # r_0
        pending = pending or [[] for _ in state.rows]
        self.router.read_ahead(state, pending)
        gains = []
        for r, row in enumerate(state.rows):
            m, bucket, trying = self.choice(state, r, pending[r])
            promised = 1 + self.record(row, m, bucket)[0]
            row.plan = (row.read + len(pending[r]), (m, bucket, trying), promised)
            gain = 1 - plain / self.score(row, m, bucket, len(pending[r]), len(state.rows))
            if self.router.members[m].reads_for_free and bucket:
                gain = max(gain, FREE_ROUND_GAIN)
            gains.append(UNTRIED_GAIN if trying else gain)
        return sum(gains) / len(gains) if self.cost_model is not None else None

    def _learn_drafting_times(self, state) -> None:
        """Average the members' drafting times the router measured since the last look (`member_timings`: member,
        seconds, verified tokens read) into t_m for a usual round's read and, for a longer one (a catch-up on a
        backlog), into the time per token read beyond a usual round."""
        for m, seconds, width in state.member_timings:
            usual = self.usual_width(m)
            if width <= usual:
                self.member_seconds[m] = _average(self.member_seconds[m], seconds)
            else:
                per_token = max(0.0, seconds - (self.member_seconds[m] or 0.0)) / (width - usual)
                self.member_read_seconds[m] = _average(self.member_read_seconds[m], per_token)
        state.member_timings.clear()

    def _time_round(self, state) -> None:
        """Start a round's clock, and average the round that ends here into `round_overhead`: its seconds beyond
        the router's drafting and the profiled verify forward (the generation loop's own work, the verify policy's,
        acceptance, cache trimming: about 10 ms a round against a 40 ms forward on the 2-core machine, where
        leaving it out promised the suffix member's rounds about 20 % more tokens per second than they gave).
        Rounds the router did not draft are not timed, nor one around a prefill of admitted requests or one
        longer than a forward (a stall)."""
        now = time.perf_counter()
        if state.round_started is not None and state.round_width is not None:
            rows = len(state.rows)
            gap = now - state.round_started - state.round_drafting - self.cost_model(rows, state.round_width)
            if 0.0 <= gap <= self.cost_model(rows, 1):
                self.round_overhead = _average(self.round_overhead, gap)
        state.round_started, state.round_drafting, state.round_width = now, 0.0, None

    def record_acceptance(self, state, drafted: list[int], accepted: list[int]) -> None:
        """Average what the target accepted of each request's round into its drafting member's estimates (and what
        it delivered of its promise, `delivery`), and judge the tries among these rounds (`_judge_try`)."""
        self._learn_drafting_times(state)
        state.round_width = 1 + max(drafted, default=0)
        for r, (row, verified, count) in enumerate(zip(state.rows, drafted, accepted)):
            m = row.last_member
            if m is None:
                continue
            if row.last_bucket is not None:  # the mean of the bucket's rounds, then a slow running average
                bucket = row.last_bucket
                rounds = self.bucket_rounds[m][bucket] = self.bucket_rounds[m].get(bucket, 0) + 1
                weight = _record_weight(rounds, BUCKET_AVERAGE)
                old = self.bucket_record[m].get(bucket, (None, None))
                self.bucket_record[m][bucket] = (
                    _average(old[0], count, PRIOR_ACCEPTED, weight),
                    _average_law(old[1], verified, PRIOR_VERIFIED, weight),
                )
            own = row.members[m]
            # a request's first round with a member starts from the member's record; the member's, from PRIOR
            own.rounds += 1
            weight = _record_weight(own.rounds, REQUEST_AVERAGE, REQUEST_PRIOR_ROUNDS)
            own.accepted = _average(own.accepted, count, self.member_accepted[m], weight)
            own.verified = _average_law(own.verified, verified, self.member_verified[m], weight)
            self.member_rounds[m] += 1
            weight = _record_weight(self.member_rounds[m], BUCKET_AVERAGE)
            self.member_accepted[m] = _average(self.member_accepted[m], count, PRIOR_ACCEPTED, weight)
            self.member_verified[m] = _average_law(self.member_verified[m], verified, PRIOR_VERIFIED, weight)
            if row.promised is not None and not row.last_try:  # a try's promise did not win it the round
                self.member_promises[m] += 1
                weight = _record_weight(self.member_promises[m], BUCKET_AVERAGE, DELIVERY_PRIOR_ROUNDS)
                self.member_promised[m] = _average(self.member_promised[m], row.promised, weight=weight)
                # the prior: the first promise delivered in full, counted as DELIVERY_PRIOR_ROUNDS rounds
                self.member_delivered[m] = _average(self.member_delivered[m], 1 + count, row.promised, weight)
            row.promised = None
            if row.last_try:
                row.last_try = False
                self._judge_try(state, r, m, verified, count)
