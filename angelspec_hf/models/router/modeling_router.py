"""The router drafter: several member drafters behind one `assistant_model`, one chosen per request and round.

No single drafter wins everywhere (AngelSpec): an MTP head for open chat, block diffusion (DFly) for code and math,
suffix matching where the output repeats its input. The router holds the members (saved and loaded as one folder,
or naming members saved on their own) and drafts each request with the member its routing policy chose for the
round (`generation/routing.py`: the scores, tries and records live there, kept by the decoding session). Each
member reads the verified tokens it has not read yet when it next drafts, so a member not chosen does not run.
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
from ...hub import is_hub_id, resolve_drafter
from ..base import AngelSpecDrafterPreTrainedModel, DraftPredictions
from ..dfly.configuration_dfly import DFlyConfig
from ..dfly.modeling_dfly import DFlyDrafter
from ..mtp.configuration_mtp import AngelSpecMTPConfig
from ..mtp.modeling_mtp import AngelSpecMTPDrafter
from ..suffix.configuration_suffix import SuffixDrafterConfig
from ..suffix.modeling_suffix import SuffixDrafter
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


@dataclass
class MemberRow:
    """What one request keeps for one member: the verified tokens (and their target states) the member has not read
    yet, and how it did on this request (the routing policy's record, `generation/routing.py`)."""

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
    """One request's members, and what the routing policy decided and remembers for it."""

    members: list[MemberRow]
    last_member: int | None = None  # the member that drafted this request's last drafting round
    last_bucket: int | None = None  # that member's outlook bucket then (None: it has no outlook)
    last_try: bool = False  # that round tried the member
    admitted: bool = False  # the router has decided which members this request tries
    read_ahead: int = 0  # leading tokens of the next drafting round's backlog the free readers have read already
    prompt: int | None = None  # tokens of the request's first round (its prompt)
    read: int = 0  # tokens of the request the router has queued for its members, prompt included
    # (read, (member, outlook bucket, whether a try), promised 1 + a_rm): the routing policy's choice for the round
    # that reads up to `read` tokens, which `propose` drafts with
    plan: tuple | None = None
    promised: float | None = None  # 1 + a_rm: the tokens its last drafting round's member promised when chosen
    tokens_left: int | None = None  # most tokens the request may still decode this round (None: unknown)


class RouterDraftState:
    """The router's per-generation state: each member's own draft state over every request, per request what each
    member has still to read and how it did, and the round's timings, which the routing policy reads."""

    def __init__(self, member_states: list, batch_size: int):
        self.members = member_states
        self.rows = [RouterRow([MemberRow() for _ in member_states]) for _ in range(batch_size)]
        self.round_started: float | None = None  # when this round began (the routing `plan`); None: not timed
        self.round_drafting = 0.0  # seconds the router drafted in it
        self.round_width: int | None = None  # the widest verify in it (1 + drafts); None: the router drafted none
        self.member_timings: list[tuple[int, float, int]] = []  # (member, seconds, tokens read) of drafting calls

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
    routes_members = True
    has_training_forward = False

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

    def forget_served_requests(self) -> None:
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
        self.check_target_once(target, tokenizer)
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
        self.config.architectures = [type(self).__name__]  # as PreTrainedModel.save_pretrained records it
        self.config.save_pretrained(directory)
        self.generation_config.save_pretrained(directory)
        self.save_target_tokenizer(directory)
        self._set_auto_map(directory, self.write_remote_code(directory) if remote_code else None)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """The router's config, then each member from where `member_paths` says (`members/<name>/` of the router's
        folder or Hub repository by default), refused with the member's own error if its checkpoint is not what its
        config says. A shipped router's name stands for its folder (`resolve_drafter`), its members beside it."""
        path = resolve_drafter(str(pretrained_model_name_or_path))
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
        for m in free:
            self._read_with(m, state, list(range(len(state.rows))))

    def _read_with(self, m: int, state: RouterDraftState, rows: list[int]) -> None:
        """Member m, which reads for free, reads what `rows` verified since it last read them, drafting nothing
        (`read`: no padded batch, no drafting call, only its index updates)."""
        pending = [state.rows[r].members[m] for r in rows]
        self.members[m].read(state.members[m], rows, [own.tokens for own in pending])
        for own in pending:
            own.tokens, own.hidden = [], []

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
        stale = [r for r, row in enumerate(state.rows) if row.plan is None or row.plan[0] != row.read]
        if stale:
            raise ValueError(
                f"Router: requests {stale} have no member chosen for this round; a routing policy plans each round "
                "before the router drafts it (generation.routing.RoutingPolicy.plan, which decoding calls)"
            )
        chosen = [row.plan[1][0] for row in state.rows]
        if hasattr(choose, "sources"):  # a DraftRound: D-cut calibrates each member's confidences apart
            choose.sources = torch.tensor(chosen)
        for row in state.rows:
            (_, row.last_bucket, row.last_try), row.promised = row.plan[1:]
            row.plan = None
        sampled = bool(getattr(choose, "sampled", torch.ones(1, dtype=torch.bool)).any())
        drafted = []
        for m in sorted(set(chosen)):
            rows = [r for r in range(batch) if chosen[r] == m]
            drafted.append((rows, *self._draft_with(m, state, rows, num_tokens, choose, keep_drafting, sampled)))
        for m, member in enumerate(self.members):  # a member that reads for free keeps its outlook current
            rows = [r for r in range(batch) if chosen[r] != m]
            if member.reads_for_free and rows:
                self._read_with(m, state, rows)
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
        if num_tokens:  # what the routing policy learns the member's drafting time from (reading only teaches none)
            state.member_timings.append((m, time.perf_counter() - start, width))
        if not whole:
            moved = set(rows)
            rest = [r for r in range(len(state.rows)) if r not in moved]
            position = {row: index for index, row in enumerate(rest + rows)}
            member_state.merge(part, [position[r] for r in range(len(state.rows))])
        return ids, (member.to_target_logits(logits.float()) if sampled else None)
