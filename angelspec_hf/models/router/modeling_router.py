"""The router drafter: several member drafters behind one `assistant_model`, one chosen per request and round.

No single drafter wins everywhere (AngelSpec): an MTP head for open chat, block diffusion (DFly) for code and math,
suffix matching where the output repeats its input. Each round the router drafts every request with the member that
promises it the most tokens per second,

    score(r, m) = d_m (1 + a_rm) / (t_m + E[t_v(R, 1 + n_rm)] + t_o),

a_rm being the tokens request r accepted per round when member m last drafted it and n_rm the drafts it had
verified, whose law the router keeps (the mean of the request's rounds with the member, then a running average;
its prior is the member's record over requests, counted as a few rounds), t_m the member's drafting time plus its
catch-up on request r, t_v the profiled verify cost of the batch of R requests, t_o the measured rest of a round
(`round_overhead`) and d_m the share of its promised tokens member m's rounds delivered (`delivery`). The
expectation is over the recorded law of n, not t_v at its mean: a cut verifies none on some rounds and many on
others, and t_v is neither linear nor, on some machines, monotone. A member not chosen
does not run: the verified tokens wait for it and it reads them all when next chosen, so its catch-up (its measured
time per token read beyond a usual round's, times the tokens waiting) is charged to the round that switches to it;
a member that reads for free (suffix) has none. The router's promise to the verify policy counts it, so the policy
adds no catch-up price of its own. A request tries every member once, and again each
`explore_tokens` verified tokens a member has not drafted it, so no estimate goes stale (a request admitted while
another's try of a member is pending does not try it, and goes by that try's verdict); the router tells the verify
policy what its next round promises (`promised_gain`), optimistic for such a try. A try costs the member's catch-up
on the request's whole backlog (a long prompt), so a try waits until that costs a small share of the request's
decoding so far (`needs_try`); it displaces the member that would have drafted the round, so a member tried before
then waits for an idle round, where no other member promises a gain, at most `explore_tokens` verified tokens
(`choice`); and tries back off across requests: a member whose try loses (the rate of its try round below the
best other member's score, or below decoding without drafts) sits out the tries of the next `b` new requests, b
doubling with each loss up to `MAX_TRY_BACKOFF` and back to 0 on a win; within a request, its re-try interval
doubles with each loss there. Which member drafts a round reads only earlier rounds, and each
member's drafts keep their own draft law, so the output keeps the target's (rejection sampling).
Written by hand: no library routes between speculative drafters.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from transformers import GenerationConfig

from ...cache_utils import pad_pending
from ...hub import is_hub_id
from ..base import AngelSpecDrafterPreTrainedModel, DraftPredictions
from ..dfly.configuration_dfly import DFlyConfig
from ..dfly.modeling_dfly import DFlyDrafter
from ..mtp.configuration_mtp import AngelSpecMTPConfig
from ..mtp.modeling_mtp import AngelSpecMTPDrafter
from ..suffix.configuration_suffix import SuffixDrafterConfig
from ..suffix.modeling_suffix import FREE_ROUND_GAIN, SuffixDrafter
from .configuration_router import RouterDrafterConfig, check_member_names


# The drafter families a router can hold, by model type: config class, model class.
MEMBER_CLASSES = {
    config.model_type: (config, model)
    for config, model in (
        (AngelSpecMTPConfig, AngelSpecMTPDrafter),
        (DFlyConfig, DFlyDrafter),
        (SuffixDrafterConfig, SuffixDrafter),
    )
}
MEMBERS_FOLDER = "members"  # in a saved router, one drafter folder per member: members/<name>/
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
MAX_TRY_BACKOFF = 32  # most new requests a member that keeps losing its tries sits out between two tries
TRY_SHARE = 0.05  # most of a request's decoding time so far that a try's catch-up (reading its backlog) may cost


def _member_location(router: str, name: str, where: str) -> tuple[str, dict]:
    """Where to load member `name` from, given the router's folder or Hub id and the member's path in its config:
    (folder or Hub id, `subfolder` option). A Hub router's member is under its `members/` or another Hub id."""
    if os.path.isdir(router):
        folder = os.path.normpath(os.path.join(router, where))
        if os.path.isdir(folder):
            return folder, {}
        if is_hub_id(where):
            return where, {}
        raise FileNotFoundError(
            f"Router {router!r}: member {name!r} is at {where!r}, and there is no folder {folder!r}"
        )
    parts = where.split("/")
    if parts[0] == MEMBERS_FOLDER and len(parts) == 2:
        return router, {"subfolder": where}
    if is_hub_id(where):
        return where, {}
    raise ValueError(
        f"Router {router!r}: member {name!r} at {where!r} is neither under {MEMBERS_FOLDER}/ nor a Hub id"
    )


def _check_member_reference(directory: str, name: str, path) -> None:
    """A member saved by reference must already be there: a drafter folder relative to `directory`, or a Hub id."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"member_paths[{name!r}] must be a folder or a Hub id, got {path!r}")
    if not os.path.isfile(os.path.join(directory, path, "config.json")) and not is_hub_id(path):
        raise ValueError(
            f"member_paths[{name!r}] = {path!r}: no drafter folder there (relative to {directory!r}) and not a Hub id"
        )


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


@dataclass
class MemberRow:
    """What the router keeps for one request and one member: the verified tokens (and their target states) the
    member has not read yet, and how it did on this request."""

    tokens: list[int] = field(default_factory=list)
    hidden: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # per verify round, per member tap
    accepted: float | None = None  # a_rm
    verified: dict[int, float] | None = None  # the law of n_rm
    rounds: int = 0  # rounds the member drafted this request
    since: int = 0  # this request's verified tokens since the member last drafted it (read at propose time)
    tries: bool = True  # whether the member is tried on this request (its backoff across requests allows it)
    explore_every: int | None = None  # this request's re-try interval (explore_tokens, doubled by each lost try)
    due_since: int | None = None  # the request's verified tokens when its due try began to wait for an idle round


@dataclass
class RouterRow:
    members: list[MemberRow]
    last_member: int | None = None  # the member that drafted this request's last drafting round
    last_bucket: int | None = None  # that member's outlook bucket then (None: it has no outlook)
    last_try: bool = False  # that round tried the member
    admitted: bool = False  # the router has decided which members this request tries
    read_ahead: int = 0  # leading tokens of the next drafting round's backlog the free readers have read already
    prompt: int | None = None  # tokens of the request's first round (its prompt)
    read: int = 0  # tokens of the request the router has queued for its members, prompt included
    plan: tuple | None = None  # (read, choice): the choice `promised_gain` made for the round at `read` tokens
    promised: float | None = None  # 1 + a_rm: the tokens its last drafting round's member promised when chosen


class RouterDraftState:
    """The router's per-generation state: each member's own draft state over every request, and per request what
    each member has still to read and how it did."""

    def __init__(self, member_states: list, batch_size: int):
        self.members = member_states
        self.rows = [RouterRow([MemberRow() for _ in member_states]) for _ in range(batch_size)]
        self.round_started: float | None = None  # when this round began (`promised_gain`); None: not timed
        self.round_drafting = 0.0  # seconds the router drafted in it
        self.round_width: int | None = None  # the widest verify in it (1 + drafts); None: the router drafted none

    def select_rows(self, rows: torch.LongTensor) -> None:
        for state in self.members:
            state.select_rows(rows)
        self.rows = [self.rows[r] for r in rows.tolist()]
        self.round_started = None  # requests retired or admitted (a prefill) between rounds: no usual round

    def add_rows(self, count: int) -> None:
        self.round_started = None
        for state in self.members:
            state.add_rows(count)
        self.rows += [RouterRow([MemberRow() for _ in self.members]) for _ in range(count)]

    def compact(self) -> None:
        for state in self.members:
            state.compact()

    def nbytes(self) -> int:
        return sum(state.nbytes() for state in self.members)


class RouterDrafter(AngelSpecDrafterPreTrainedModel):
    """Member drafters of one target behind one `assistant_model`, routed per request and round (module docstring).

    Build one with `RouterDrafter.from_members([mtp, dfly, suffix])`; it saves and loads as one folder, its config
    naming its members (held under `members/`, or saved on their own: `save_pretrained(dir, member_paths=...)`). Drafts are in the target's vocabulary (each member's mapped through its own draft vocabulary).
    """

    config_class = RouterDrafterConfig
    prices_its_drafting = True

    def __init__(self, config: RouterDrafterConfig, members: list[AngelSpecDrafterPreTrainedModel] | None = None):
        super().__init__(config)
        self.post_init()  # before the members join: initialising weights must never touch trained members
        if members is None:
            members = []
            for member_config in config.members:
                if member_config["model_type"] not in MEMBER_CLASSES:
                    raise ValueError(
                        f"Unknown member model_type {member_config['model_type']!r}; a router holds "
                        f"{', '.join(sorted(MEMBER_CLASSES))}"
                    )
                config_class, model_class = MEMBER_CLASSES[member_config["model_type"]]
                members.append(model_class(config_class.from_dict(member_config)))
        if not members:
            raise ValueError("A router needs at least one member drafter")
        self.members = nn.ModuleList(members)
        self.member_names = config.member_names or [member.config.drafter_kind for member in members]
        indices = sorted({i for member in members for i in member.target_hidden_state_indices()})
        self.hidden_indices = indices
        self.member_taps = [[indices.index(i) for i in member.target_hidden_state_indices()] for member in members]
        self.generation_config.num_assistant_tokens = self.default_num_draft_tokens()
        self._reset_records()

    def _reset_records(self) -> None:
        """What the router learns while serving, empty: per member its round costs and acceptance records."""
        count = len(self.members)
        self.member_seconds: list[float | None] = [None] * count  # t_m of a usual round
        self.member_read_seconds: list[float | None] = [None] * count  # per token read beyond a usual round
        self.member_accepted: list[float | None] = [None] * count  # a_m over requests
        self.member_verified: list[dict[int, float] | None] = [None] * count
        self.member_rounds = [0] * count  # rounds averaged into a_m
        # Tokens per round (1 + a) each member promised when chosen and delivered, averaged over its rounds.
        self.member_promised: list[float | None] = [None] * count
        self.member_delivered: list[float | None] = [None] * count
        self.round_overhead: float | None = None  # a drafting round's seconds beyond drafting and the verify forward
        # For members with an outlook: (accepted, law of verified) per round, by outlook bucket.
        self.bucket_record: list[dict[int, tuple[float, dict[int, float]]]] = [{} for _ in range(count)]
        self.bucket_rounds: list[dict[int, int]] = [{} for _ in range(count)]  # rounds averaged into each record
        self.try_backoff = [0] * count  # new requests a member sits out after a lost try (doubling)
        self.try_wait = [0] * count  # new requests still to pass before the member's next try

    def forget_served_requests(self) -> None:
        self._reset_records()
        for member in self.members:
            member.forget_served_requests()

    @classmethod
    def from_members(cls, members: list[AngelSpecDrafterPreTrainedModel], names: list[str] | None = None):
        """A router over these drafters (their weights shared, not copied), all for the same target."""
        first = members[0].config
        for member in members[1:]:
            if member.config.vocab_size != first.vocab_size:
                raise ValueError(
                    f"Members draft for different vocabularies ({first.vocab_size} and {member.config.vocab_size})"
                )
        config = RouterDrafterConfig(
            members=[member.config.to_dict() for member in members],
            member_names=names,
            target_config=dict(first.target_config),
            target_name_or_path=first.target_name_or_path,
            target_tokenizer_fingerprint=first.target_tokenizer_fingerprint,
            target_embedding_probe=first.target_embedding_probe,
        )
        return cls(config, members=list(members))

    # -- the drafter contract ---------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.members[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.members[0].dtype

    def default_num_draft_tokens(self) -> int:
        """`num_draft_tokens`, else the most any member drafts by default (1 while the members are being built)."""
        if self.config.num_draft_tokens is not None:
            return self.config.num_draft_tokens
        members = self._modules.get("members") or []
        return max((int(member.generation_config.num_assistant_tokens) for member in members), default=1)

    def max_num_draft_tokens(self) -> int | None:
        most = [member.max_num_draft_tokens() for member in self.members]
        return None if None in most else max(most)

    def target_hidden_state_indices(self) -> list[int]:
        return list(self.hidden_indices)

    def draft_layers(self) -> list:
        return [layer for member in self.members for layer in member.draft_layers()]

    def forward(self, *args, **kwargs) -> DraftPredictions:
        raise NotImplementedError("Train the members one by one; the router only chooses between them.")

    def check_target(self, target, tokenizer=None) -> None:
        for name, member in zip(self.member_names, self.members):
            try:
                member.check_target(target, tokenizer)
            except ValueError as error:
                raise ValueError(f"Router member {name!r}: {error}") from error

    def bind_target(self, target, tokenizer=None) -> "RouterDrafter":
        self.check_target(target, tokenizer)
        for member in self.members:
            member.bind_target(target, tokenizer)
        self._borrow_target(target, tokenizer)
        return self

    def remote_code_modules(self) -> list:
        import importlib

        modules = super().remote_code_modules()
        for config_class, model_class in MEMBER_CLASSES.values():
            modules += [
                importlib.import_module(model_class.__module__),
                importlib.import_module(config_class.__module__),
            ]
        return modules

    def write_checkpoint(
        self, directory: str, *args, remote_code: bool = False, member_paths: dict | None = None, **kwargs
    ) -> None:
        """The router's config and generation config, and each member as a drafter folder of its own under
        `members/<name>/` (it loads alone too) — except the members `member_paths` names (`{name: path}`, a folder
        relative to `directory` or a Hub id, where that member is already saved): those are only named in the config,
        their weights not written again. With `remote_code`, the package's code for the router and its members."""
        check_member_names(self.member_names)  # before anything is written
        references = dict(member_paths or {})
        unknown = sorted(set(references) - set(self.member_names))
        if unknown:
            raise ValueError(f"member_paths names {unknown}, not members of this router ({self.member_names})")
        for name, path in references.items():
            _check_member_reference(directory, name, path)
        paths = []
        for name, member in zip(self.member_names, self.members):
            if name in references:
                paths.append(references[name])
            else:
                member.write_checkpoint(
                    os.path.join(directory, MEMBERS_FOLDER, name), *args, remote_code=remote_code, **kwargs
                )
                paths.append(f"{MEMBERS_FOLDER}/{name}")
        provenance = ("auto_map", "_name_or_path")  # where a member was loaded from is not part of its config
        self.config.members = [
            {key: value for key, value in member.config.to_dict().items() if key not in provenance}
            for member in self.members
        ]
        self.config.member_names = list(self.member_names)
        self.config.member_paths = paths
        self.config.save_pretrained(directory)
        self.generation_config.save_pretrained(directory)
        self.save_target_tokenizer(directory)
        self._set_auto_map(directory, self.write_remote_code(directory) if remote_code else None)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """The router's config, then each member from where `member_paths` says (`members/<name>/` of the router's
        folder or Hub repository by default), refused with the member's own error if its checkpoint is not what its
        config says."""
        path = str(pretrained_model_name_or_path)
        config = kwargs.pop("config", None) or cls.config_class.from_pretrained(path)
        options = {key: kwargs[key] for key in ("dtype", "torch_dtype", "device_map") if key in kwargs}
        if not config.member_names or len(config.member_names) != len(config.members):
            raise ValueError(f"Router checkpoint {path!r} does not name its members (member_names in config.json)")
        paths = config.member_paths or [f"{MEMBERS_FOLDER}/{name}" for name in config.member_names]
        members = []
        for name, member_config, where in zip(config.member_names, config.members, paths):
            config_class, model_class = MEMBER_CLASSES[member_config["model_type"]]
            location, subfolder = _member_location(path, name, where)
            members.append(model_class.from_pretrained(location, **subfolder, **options))
        router = cls(config, members=members)
        try:
            router.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass
        return router.eval()

    def record_output(self, output_ids: list[int]) -> None:
        for member in self.members:
            member.record_output(output_ids)

    def new_draft_state(self, batch_size: int = 1) -> RouterDraftState:
        return RouterDraftState([member.new_draft_state(batch_size) for member in self.members], batch_size)

    # -- routing ----------------------------------------------------------------------------------------------------

    def outlooks(self, state: RouterDraftState, r: int, pending: list[int] = ()) -> list[int | None]:
        """Each member's `outlook` on request r now (the suffix member's current match length), bucketed by
        powers of two; None for a member without one. `pending`: tokens verified since the router last drafted."""
        looks = []
        for m, member in enumerate(self.members):
            own = state.rows[r].members[m]
            unread = pending[state.rows[r].read_ahead :] if member.reads_for_free else pending  # see read_ahead
            look = member.outlook(state.members[m], r, own.tokens + list(unread))
            looks.append(None if look is None else int(look).bit_length())
        return looks

    def score(self, row: RouterRow, m: int, bucket: int | None = None, pending: int = 0, rows: int = 1) -> float:
        """Expected tokens per second of a round drafted by member m for this request (module docstring), its
        catch-up on the tokens waiting for it (`pending` more verified since the router last drafted) included, in
        a batch of `rows` requests; for a member with an outlook, a_m and n_m are its record at this outlook's
        bucket."""
        accepted, verified = self.record(row, m, bucket)
        accepted = (1 + accepted) * self.delivery(m) - 1
        seconds = (self.member_seconds[m] or 0.0) + self.catch_up_seconds_of(m, len(row.members[m].tokens) + pending)
        return self._rate(accepted, verified, seconds, rows)

    def record(self, row: RouterRow, m: int, bucket: int | None = None) -> tuple[float, dict[int, float]]:
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
        by it."""
        if self.member_promised[m] is None:
            return 1.0
        return self.member_delivered[m] / self.member_promised[m]

    def usual_width(self, m: int) -> int:
        """Verified tokens member m reads in a usual round: its drafts per round and the bonus token."""
        return int(self.members[m].generation_config.num_assistant_tokens) + 1

    def catch_up_seconds_of(self, m: int, waiting: int) -> float:
        """Member m's time to read `waiting` verified tokens beyond a usual round's (none for a member that reads
        for free; unknown until it has caught up once, counted as none then: its first try is exploration)."""
        usual = self.usual_width(m)
        if self.members[m].reads_for_free or waiting <= usual:
            return 0.0
        return (waiting - usual) * (self.member_read_seconds[m] or 0.0)

    def _rate(self, accepted: float, verified: dict[int, float], seconds: float, rows: int = 1) -> float:
        """(1 + a) / (t + E[t_v(R, 1 + n)] + t_o): a request's tokens per second in rounds of R = `rows` requests
        that draft for `seconds` and verify n drafts per request (`verified`: n's law), a of them accepted (t_v the
        profiled verify cost of the batch, whose widening costs more where the verify forward is compute-bound;
        t_o the measured `round_overhead`; without a profile, one unit per token and no overhead)."""
        model = self.verify_cost_model
        if model is None:
            return (1 + accepted) / (seconds + sum(weight * (1 + n) for n, weight in verified.items()))
        verify = sum(weight * model(rows, 1 + n) for n, weight in verified.items())
        return (1 + accepted) / (seconds + verify + (self.round_overhead or 0.0))

    def admit(self, state: RouterDraftState, r: int) -> None:
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
            own.explore_every = self.config.explore_tokens

    def needs_try(self, row: RouterRow, m: int, pending: int = 0, rows: int = 1) -> bool:
        """Whether member m (one without an outlook) is due a try on this request: one the request tries (`admit`)
        that never drafted it, or not for its re-try interval (`pending` tokens verified since the router last
        drafted), once the try is affordable. A try first reads the member's whole backlog (the prompt, on a
        first try), so it waits until that catch-up costs at most `TRY_SHARE` of the time the request has decoded
        so far, counted at t_v(R, 1) per token: soon after a short prompt, late or never after a long one (a
        RAG document), where the catch-up alone would cost more than the try could win back."""
        own = row.members[m]
        if not own.tries or not (own.accepted is None or own.since + pending >= own.explore_every):
            return False
        if self.verify_cost_model is None:
            return True
        decoded = row.read - (row.prompt or 0) + pending
        budget = TRY_SHARE * decoded * self.verify_cost_model(rows, 1)
        return self.catch_up_seconds_of(m, len(own.tokens) + pending) <= budget

    def _judge_try(self, state: RouterDraftState, r: int, m: int, verified: int, accepted: int) -> None:
        """After a round that tried member m on request r and had `accepted` of `verified` drafts accepted: a win
        (that round's rate above every other member's score and above decoding without drafts) clears its backoff;
        a loss doubles it, across requests and on this request."""
        row = state.rows[r]
        looks = self.outlooks(state, r)
        rows = len(state.rows)
        others = [self.score(row, o, looks[o], rows=rows) for o in range(len(self.members)) if o != m]
        rate = self._rate(accepted, {verified: 1.0}, self.member_seconds[m] or 0.0, rows)
        if rate >= max(others, default=0.0) and rate > self._rate(0.0, NO_DRAFTS, 0.0, rows):
            self.try_backoff[m] = self.try_wait[m] = 0
            return
        self.try_backoff[m] = min(MAX_TRY_BACKOFF, max(1, 2 * self.try_backoff[m]))
        self.try_wait[m] = self.try_backoff[m]
        row.members[m].explore_every *= 2

    def choice(self, state: RouterDraftState, r: int, pending: list[int] = ()) -> tuple[int, int | None, bool]:
        """Request r's member for this round, its outlook bucket, and whether it is a try: a member without an
        outlook due a try (the cheapest first), else the best score; where no score beats decoding without drafts,
        a member that reads for free and has a match (the suffix member: `promised_gain` lets its cut decide).

        A try displaces the member that would have drafted the round, so a due try of a member with a record (one
        tried before, on any request) waits for an idle round, one where no other member's score beats decoding
        without drafts and no free reader has a match (a suffix round with a long match is worth more than a try
        that usually loses), but at most `explore_tokens` verified tokens."""
        row, looks = state.rows[r], self.outlooks(state, r, pending)
        self.admit(state, r)
        rows = len(state.rows)
        due = [m for m, look in enumerate(looks) if look is None and self.needs_try(row, m, len(pending), rows)]
        scores = [self.score(row, m, looks[m], len(pending), rows) for m in range(len(self.members))]
        plain = self._rate(0.0, NO_DRAFTS, 0.0, rows)
        matched = [f for f, member in enumerate(self.members) if member.reads_for_free and looks[f]]
        if due:
            now = row.read + len(pending)
            best = max((score for m, score in enumerate(scores) if m not in due), default=0.0)
            idle = best <= plain and not matched
            for m in due:
                if row.members[m].due_since is None:
                    row.members[m].due_since = now
            ready = [
                m
                for m in due
                if idle
                or self.member_accepted[m] is None
                or now - row.members[m].due_since >= self.config.explore_tokens
            ]
            if ready:
                m = min(ready, key=lambda m: self.member_seconds[m] or 0.0)
                return m, None, True
        m = max(range(len(self.members)), key=scores.__getitem__)
        if scores[m] <= plain and matched:
            m = max(matched, key=scores.__getitem__)
        return m, looks[m], False

    def promised_gain(self, state: RouterDraftState, pending: list[list[int]] | None = None) -> float | None:
        """Mean over requests of g = 1 − r_0 / score(r, m_r), r_0 = 1 / t_v(1) the rate without drafts and m_r the
        request's choice: what drafting each request with it saves; UNTRIED_GAIN for a request due a try (so the
        round drafts and the member is tried), and at least FREE_ROUND_GAIN for one whose member reads for free and
        has a match. Such a member's record is an average over its outlook bucket, while D-cut cuts each round by
        the calibrated confidence of its own drafts, verifying none where they would not pay: the cut, not the
        record, decides (the suffix drafter alone drafts so, and beat the router that skipped by its records on six
        of eight Spec-Bench-style domains). `pending[r]`: tokens request r verified since the router last drafted.
        None without a profile."""
        if self.verify_cost_model is None or not state.rows:
            return None
        self._time_round(state)
        plain = self._rate(0.0, NO_DRAFTS, 0.0, len(state.rows))  # r_0
        pending = pending or [[] for _ in state.rows]
        self.read_ahead(state, pending)
        gains = []
        for r, row in enumerate(state.rows):
            m, bucket, trying = self.choice(state, r, pending[r])
            row.plan = (row.read + len(pending[r]), (m, bucket, trying))  # what `propose` drafts this round with
            gain = 1 - plain / self.score(row, m, bucket, len(pending[r]), len(state.rows))
            if self.members[m].reads_for_free and bucket:
                gain = max(gain, FREE_ROUND_GAIN)
            gains.append(UNTRIED_GAIN if trying else gain)
        return sum(gains) / len(gains)

    def _time_round(self, state: RouterDraftState) -> None:
        """Start a round's clock, and average the round that ends here into `round_overhead`: its seconds beyond
        the router's drafting and the profiled verify forward (the generation loop's own work, the verify policy's,
        acceptance, cache trimming: about 10 ms a round against a 40 ms forward on the 2-core machine, where
        leaving it out promised the suffix member's rounds about 20 % more tokens per second than they gave).
        Rounds the router did not draft are not timed, nor one around a prefill of admitted requests or one
        longer than a forward (a stall)."""
        now = time.perf_counter()
        if state.round_started is not None and state.round_width is not None:
            rows = len(state.rows)
            gap = now - state.round_started - state.round_drafting - self.verify_cost_model(rows, state.round_width)
            if 0.0 <= gap <= self.verify_cost_model(rows, 1):
                self.round_overhead = _average(self.round_overhead, gap)
        state.round_started, state.round_drafting, state.round_width = now, 0.0, None

    def read_ahead(self, state: RouterDraftState, pending: list[list[int]]) -> None:
        """Members that read for free (suffix) read the tokens verified since the router last drafted now, before
        the router weighs them, so that their outlook is current even through rounds it does not draft (it would
        otherwise judge the suffix member by an index that has not seen the prompt, and never draft); the drafting
        round that follows skips what they read here (`RouterRow.read_ahead`)."""
        free = [m for m, member in enumerate(self.members) if member.reads_for_free]
        fresh = [tokens[row.read_ahead :] for row, tokens in zip(state.rows, pending)]
        if not free or not any(fresh):
            return
        for row, tokens, new in zip(state.rows, pending, fresh):
            row.read_ahead = len(tokens)
            for m in free:
                row.members[m].tokens.extend(new)
                row.members[m].hidden.append(())  # a free reader reads tokens only, no target states
        for m in free:
            self._draft_with(m, state, list(range(len(state.rows))), 0, None, None, False)

    def record_acceptance(self, state: RouterDraftState, drafted: list[int], accepted: list[int]) -> None:
        """Average what the target accepted of each request's round into its drafting member's estimates (and what
        it delivered of its promise, `delivery`), and judge the tries among these rounds (`_judge_try`)."""
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
                self.member_promised[m] = _average(self.member_promised[m], row.promised, weight=weight)
                self.member_delivered[m] = _average(self.member_delivered[m], 1 + count, weight=weight)
            row.promised = None
            if row.last_try:
                row.last_try = False
                self._judge_try(state, r, m, verified, count)

    # -- drafting ---------------------------------------------------------------------------------------------------

    def propose(
        self,
        state: RouterDraftState,
        target_hidden: tuple[torch.Tensor, ...],
        new_token_ids: torch.LongTensor,
        num_tokens: int,
        choose: Callable[[torch.Tensor], torch.LongTensor],
        keep_drafting: Callable[[], bool] | None = None,
        new_lengths: torch.LongTensor | None = None,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """Queue the verified tokens for every member, pick each request's member, and let each picked member draft
        its requests (apart from the others when the batch splits: `choose.rows(...)`, the members' states split
        and merged back). Returns target-vocabulary ids [B, K] and draft logits [B, K, V] over the target
        vocabulary (−inf outside a member's draft vocabulary; positions a member did not draft are never verified).
        Greedy acceptance reads only the ids, so when no request samples the logits are empty, [B, K, 0]."""
        began = time.perf_counter()
        batch, count = new_token_ids.shape
        lengths = new_lengths.tolist() if new_lengths is not None else [count] * batch
        for r, (row, tokens) in enumerate(zip(state.rows, new_token_ids.tolist())):
            for member, member_row, taps in zip(self.members, row.members, self.member_taps):
                start = row.read_ahead if member.reads_for_free else 0  # `read_ahead` read those already
                member_row.tokens.extend(tokens[start : lengths[r]])
                member_row.hidden.append(tuple(target_hidden[j][r, start : lengths[r]] for j in taps))
            row.read_ahead = 0
            row.read += lengths[r]
            row.prompt = lengths[r] if row.prompt is None else row.prompt
        choices = [
            row.plan[1] if row.plan is not None and row.plan[0] == row.read else self.choice(state, r)
            for r, row in enumerate(state.rows)
        ]
        chosen = [m for m, _, _ in choices]
        if hasattr(choose, "sources"):  # a DraftRound: D-cut calibrates each member's confidences apart
            choose.sources = torch.tensor(chosen)
        for row, (m, bucket, trying) in zip(state.rows, choices):
            row.last_bucket, row.last_try, row.plan = bucket, trying, None
            row.promised = 1 + self.record(row, m, bucket)[0]
        sampled = bool(getattr(choose, "sampled", torch.ones(1, dtype=torch.bool)).any())
        drafted = []
        for m in sorted(set(chosen)):
            rows = [r for r in range(batch) if chosen[r] == m]
            drafted.append((rows, *self._draft_with(m, state, rows, num_tokens, choose, keep_drafting, sampled)))
        for m, member in enumerate(self.members):  # a member that reads for free keeps its outlook current
            rows = [r for r in range(batch) if chosen[r] != m]
            if member.reads_for_free and rows:
                self._draft_with(m, state, rows, 0, choose, keep_drafting, sampled)
        for row, m, length in zip(state.rows, chosen, lengths):
            row.last_member = m
            for other, own in enumerate(row.members):
                own.since = 0 if other == m else own.since + length
                own.due_since = None if other == m else own.due_since  # drafting, it is no longer waiting
        steps = max(ids.shape[1] for _, ids, _ in drafted)
        draft_ids = new_token_ids.new_zeros(batch, steps)
        draft_logits = torch.zeros(batch, steps, self.config.vocab_size if sampled else 0, device=new_token_ids.device)
        for rows, ids, logits in drafted:
            where = torch.tensor(rows, device=new_token_ids.device)
            draft_ids[where, : ids.shape[1]] = ids
            if sampled:
                draft_logits[where, : ids.shape[1]] = logits.to(draft_logits.dtype)
        state.round_drafting += time.perf_counter() - began
        return draft_ids, draft_logits

    def _draft_with(
        self, m: int, state: RouterDraftState, rows: list[int], num_tokens, choose, keep_drafting, sampled
    ):
        """Member m drafts `rows`, reading everything they verified since it last drafted them."""
        member, member_state = self.members[m], state.members[m]
        whole = len(rows) == len(state.rows)
        part = member_state if whole else member_state.split(rows)
        pending = [state.rows[r].members[m] for r in rows]
        width = max(len(own.tokens) for own in pending)
        tokens, lengths, hidden = pad_pending(
            [own.tokens for own in pending], [own.hidden for own in pending], len(self.member_taps[m]), self.device
        )
        for own in pending:
            own.tokens, own.hidden = [], []
        if not whole and not hasattr(choose, "rows"):
            raise TypeError("A router drafting requests apart needs a DraftRound as `choose` (draft_round passes one)")
        picker = choose if whole else choose.rows(rows)
        most = [num_tokens, int(member.generation_config.num_assistant_tokens), member.max_num_draft_tokens()]
        steps = min(value for value in most if value is not None)  # each member at most its own tokens per round
        if steps:  # and D-cut's early exit weighs no steps beyond them
            picker.max_steps = steps
        start = time.perf_counter()
        ids, logits = member.propose(
            part,
            hidden,
            tokens,
            steps,
            picker,
            keep_drafting=keep_drafting if whole else picker.keep_drafting,
            new_lengths=lengths,
        )
        seconds, usual = time.perf_counter() - start, self.usual_width(m)
        if num_tokens and width <= usual:  # a usual round's drafting time (reading only teaches none)
            self.member_seconds[m] = _average(self.member_seconds[m], seconds)
        elif num_tokens:  # a catch-up on a backlog: the time per token read beyond a usual round
            per_token = max(0.0, seconds - (self.member_seconds[m] or 0.0)) / (width - usual)
            self.member_read_seconds[m] = _average(self.member_read_seconds[m], per_token)
        if not whole:
            moved = set(rows)
            rest = [r for r in range(len(state.rows)) if r not in moved]
            position = {row: index for index, row in enumerate(rest + rows)}
            member_state.merge(part, [position[r] for r in range(len(state.rows))])
        return ids, (member.to_target_logits(logits.float()) if sampled else None)
