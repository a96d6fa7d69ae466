"""Batched speculative decoding with continuous refill and D-cut across requests (AngelSpec §4).

transformers' `generate()` runs speculative decoding one sequence at a time. This engine serves many requests at
once on plain transformers models and caches, one round at a time:

    admit   waiting requests join while the batch has room (prefilled on their own, then merged in; a prompt
            prefilled a moment ago is not prefilled again, `PromptPrefills`)
    draft   the drafter reads the tokens verified since it last ran and proposes for every row in one batched
            call (its cache is ragged like the target's), as many as the verify policy (`policies.py`) asks;
            skipped when D-cut expects no draft to pay this round
    cut     the policy picks each row's verified depth: D-cut ranks all drafted tokens of all rows by calibrated
            confidence and keeps the set that maximises expected tokens per second under this machine's
            verify-cost profile; `constant` and `heuristic` set a depth per row
    verify  one target forward over [bonus, kept drafts] of every row, padded to the widest row
    accept  per row: greedy match or speculative rejection sampling; rejected drafts become masked holes
    retire  finished rows leave (survivors from the end take their slots: one row copied per leaver); the cache
            squeezes its holes out when they waste more than half of it

Rows accept different numbers of tokens each round: `RaggedCache` keeps one cache tensor with a per-row validity
mask and per-row positions. With no drafter the same loop is batched autoregressive decoding, the baseline.
Written here because no library in this stack batches speculative decoding: transformers' assisted loop is
batch-size 1, and servers such as vLLM are outside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
import os
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.utils import logging

from ..cache_utils import RaggedCache, fewest_moves, pad_pending, sliding_windows, with_cache
from ..metrics import SpeculationStats, round_profile
from .draft_round import DraftRound, draw, draw_rows
from .policies import RowState, VerifyPolicy
from .session import DecodingSession
from .target_states import TargetStateTaps
from .timing import device_clock


logger = logging.get_logger(__name__)


@dataclass
class Request:
    """One generation request. `eos_token_id` defaults to the target's; sampling settings are per request.

    A sampled request's `seed` seeds its random draws. With `reproducible` (and a seed) its text depends on the
    seed alone — not on the drafter, the depth D-cut verified or the other requests in the batch: each token is a
    sample of the target's law drawn from (seed, position) (`seeded_sample`), and drafts are accepted while they
    equal those samples (fewer than rejection sampling accepts), as an API's `seed` promises.
    """

    input_ids: list[int]
    max_new_tokens: int = 128
    eos_token_id: int | list[int] | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    request_id: int | str | None = None
    reproducible: bool = False


@dataclass
class RequestOutput:
    """What a request produced: new tokens, why it stopped (`eos`, `length`, `error`, or `cancelled` by
    `SpeculativeEngine.cancel`), and its speculation stats."""

    request_id: int | str | None
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)


@dataclass
class EngineStats:
    """What one `generate()` call cost: wall time, time per phase, peak memory, rounds and batch occupancy."""

    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("prefill", "draft", "verify", "other"), 0.0)
    )
    rounds: int = 0
    generated_tokens: int = 0
    peak_rows: int = 0
    peak_cache_bytes: int = 0
    peak_rss_bytes: int = 0
    skipped_drafts: int = 0  # rounds in which the policy (D-cut) decided that no draft could pay for its verification
    reused_prefills: int = 0  # requests whose prompt's prefill was kept from an earlier request (`PromptPrefills`)
    round_seconds: list[tuple[float, float, float]] = field(default_factory=list)  # (forward, drafting, whole round)
    drafting: SpeculationStats = field(default_factory=SpeculationStats)  # drafting time: first token, further ones

    def round_profile(self) -> dict | None:
        """Median milliseconds per round in the target forward, in drafting and in the rest (`metrics.round_profile`)."""
        return round_profile(self.round_seconds)


@dataclass
class _Row:
    """A running request: its output so far, the token to feed next, and the verified positions the drafter has
    not seen yet (their target hidden states and the token after each)."""

    request: Request
    output: RequestOutput
    eos: set[int]
    processors: LogitsProcessorList
    generator: torch.Generator | None
    next_token: int
    policy_row: RowState | None = None  # what the verify policy keeps for this request
    pending_hidden: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # per verify round, per tapped layer
    pending_tokens: list[int] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.output.output_ids)

    def emit(self, tokens: list[int]) -> None:
        """Append generated tokens, stopping at EOS or the length limit."""
        for token in tokens:
            self.output.output_ids.append(token)
            if token in self.eos:
                self.output.finish_reason = "eos"
                return
            if self.remaining <= 0:
                self.output.finish_reason = "length"
                return


class PromptPrefills:
    """The prefills of recent prompts (KV cache, last logits, tapped hidden states), kept for a later request with
    the same prompt: the samples of one prompt (best-of-n, reinforcement-learning rollouts, a sampled regeneration's
    passes) then pay one prefill between them. A prefill depends on the prompt's tokens alone, so a kept one is the
    one the request would compute: outputs do not change. At most `max_tokens` prompt tokens are kept, the least
    recently used prompts leaving first. (Written here: transformers' prefix caching is for one `generate()` call.)"""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.kept: OrderedDict[tuple[int, ...], tuple] = OrderedDict()
        self.tokens = 0

    def get(self, prompt: tuple[int, ...]) -> tuple | None:
        """(cache, last logits, tapped hidden states) of `prompt`'s prefill, or None; the cache is the caller's copy."""
        kept = self.kept.get(prompt)
        if kept is None:
            return None
        self.kept.move_to_end(prompt)
        cache, logits, hidden = kept
        return cache.copy(), logits, hidden

    def put(self, prompt: tuple[int, ...], cache: RaggedCache, logits: torch.Tensor, hidden) -> None:
        if not 0 < len(prompt) <= self.max_tokens or prompt in self.kept:
            return
        self.kept[prompt] = (cache.copy(), logits, hidden)
        self.tokens += len(prompt)
        while self.tokens > self.max_tokens:
            self.tokens -= len(self.kept.popitem(last=False)[0])


def kv_bytes_per_token(target) -> int:
    """Bytes of target KV cache one token occupies (keys and values, every layer)."""
    config = target.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * target.dtype.itemsize


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on `device` (CUDA: free device memory; CPU: available system memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resident_memory_bytes(device: torch.device) -> int:
    """Memory in use now: allocated CUDA memory, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class SpeculativeEngine:
    """Serve many requests at once with a drafter (or none: batched AR) on a transformers target.

    Args:
        target: the target `PreTrainedModel` (decoder-only; full or sliding-window attention).
        drafter: an AngelSpec drafter bound to (or trained for) `target`, or `None` for batched autoregressive decoding.
        policy: the verify policy (`policies.py`): a `VerifyPolicy`, a label (`"dcut"`, `"heuristic"`,
            `"constant-K"`), or None for the drafter's generation config, as `generate()` reads it (D-cut by default).
        max_batch_size: most requests decoded together; more are queued and join as others finish.
        memory_budget_bytes: most bytes the target KV cache may hold (default: half of the free memory at start);
            requests wait in the queue while admitting them would exceed it.
        cost_model: D-cut's verify-cost profile (default: this machine's, profiled and cached on first use).
        past_context: serve requests longer than the target's `max_position_embeddings` (refused by default).
        prompt_cache_tokens: most prompt tokens whose prefills are kept for later requests with the same prompt
            (`PromptPrefills`; 0, the default: none).
    """

    def __init__(
        self,
        target,
        drafter=None,
        policy: VerifyPolicy | str | None = None,
        max_batch_size: int = 16,
        memory_budget_bytes: int | None = None,
        cost_model=None,
        tokenizer=None,
        past_context: bool = False,
        prompt_cache_tokens: int = 0,
    ):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        if not isinstance(prompt_cache_tokens, int) or prompt_cache_tokens < 0:
            raise ValueError(f"prompt_cache_tokens must be a non-negative integer, got {prompt_cache_tokens!r}")
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise ValueError(
                f"memory_budget_bytes must be positive (None: half the free memory), got {memory_budget_bytes}"
            )
        self.target = target
        self.drafter = drafter
        self.max_batch_size = max_batch_size
        self.device = target.device
        self.bytes_per_token = kv_bytes_per_token(target)
        self.memory_budget_bytes = (
            memory_budget_bytes if memory_budget_bytes is not None else available_memory_bytes(self.device) // 2
        )
        self.vocab_size = target.config.get_text_config().vocab_size
        # Requests longer than the target's context are refused, as serving stacks do (vLLM's max_model_len), unless
        # `past_context`: `generate()` on a batch decodes on past it, as plain `generate()` does.
        context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        self.context_limit = None if past_context else context
        self.sliding_windows = sliding_windows(target.config)  # None: every layer attends to the whole context
        default_eos = target.generation_config.eos_token_id
        self.default_eos = (
            default_eos if isinstance(default_eos, list) else [] if default_eos is None else [default_eos]
        )
        self.session: DecodingSession | None = None
        self.max_draft = 0
        if drafter is not None:
            drafter.bind_target(target, tokenizer)
            self.session = DecodingSession(target, drafter, policy, cost_model, max_rows=max_batch_size)
            self.max_draft = self.session.max_draft
        # the target states the drafter reads, hooked on their layers (none without a drafter)
        self.taps = TargetStateTaps(target, drafter.target_hidden_state_indices() if drafter is not None else [])
        self.stats = EngineStats()
        self._submitted = 0
        self._rows_without_drafts: set[int] | None = None  # after a drafting failure (`_drafting_paused`)
        self._waiting: deque[tuple[Request, RequestOutput]] = deque()
        self._cancelled_running = False  # a running request was cancelled: it leaves before the next round
        self.rows: list[_Row] = []
        self.cache = RaggedCache(0, self.device)
        self.draft_state = self.drafter.new_draft_state(0) if self.drafter is not None else None
        self.prompt_prefills = PromptPrefills(prompt_cache_tokens) if prompt_cache_tokens else None

    # -- public API -----------------------------------------------------------------------------------------------

    def submit(self, request, **defaults) -> RequestOutput:
        """Queue one request (a `Request`, or token ids — a list or a tensor — with `defaults` such as
        `max_new_tokens`) and return its output, which fills in as `step()` runs. A request that cannot be served
        (token ids outside the vocabulary, bad sampling settings, no room in the context or in memory) comes back
        finished at once, `finish_reason="error"` with the reason; it never stops the others. The `Request` object is
        not modified, so one object may be submitted several times (each is served on its own)."""
        if not isinstance(request, Request):
            request = Request(input_ids=request, **defaults)
        self._submitted += 1
        request_id = request.request_id if request.request_id is not None else self._submitted - 1
        input_ids, problem = _token_list(request.input_ids, self.vocab_size)
        output = RequestOutput(request_id, input_ids)
        request = dataclasses.replace(request, input_ids=input_ids, request_id=request_id)
        problem = problem or self._problem(request)
        if problem is not None:
            output.finish_reason, output.error = "error", f"request {request_id!r} rejected: {problem}"
            logger.warning(output.error)
        else:
            self._waiting.append((request, output))
        return output

    def cancel(self, output: RequestOutput) -> None:
        """Finish a waiting or running request now, `finish_reason="cancelled"` (its client went away, its deadline
        passed): a waiting one leaves the queue, a running one the batch at the next `step()`, before its round."""
        if output.finish_reason is not None:
            return
        output.finish_reason = "cancelled"
        waiting = len(self._waiting)
        self._waiting = deque(item for item in self._waiting if item[1] is not output)
        self._cancelled_running |= len(self._waiting) == waiting

    def has_unfinished(self) -> bool:
        """Whether requests are waiting or running."""
        return bool(self._waiting or self.rows)

    @torch.no_grad()
    def step(self) -> None:
        """One engine iteration: admit waiting requests, run one draft-verify round over the batch, retire the
        finished. A failure in one request's own work (its prefill, acceptance or sampling) finishes that request
        with `finish_reason="error"`; one in the batch's shared forwards cannot be pinned on a request, so it
        finishes the rows running at that moment (with the error) and the engine goes on with the waiting ones."""
        if self._cancelled_running:
            self._cancelled_running = False
            self._retire()
        self._admit()
        timing = None
        if self.rows:
            start = time.perf_counter()
            try:
                timing = self._round()
            except Exception as error:  # noqa: BLE001  (reported on every affected request, never swallowed)
                self._fail_running(error)
        self._record_memory()
        self._retire()
        if timing is not None:  # the round and its bookkeeping, the admissions' prefills apart
            self.stats.round_seconds.append((*timing, time.perf_counter() - start))

    @torch.no_grad()
    def generate(self, requests, progress: bool = False, **defaults) -> list[RequestOutput]:
        """Run `requests` (each a `Request`, or token ids with `defaults` such as `max_new_tokens`) to completion;
        outputs come back in request order (see `submit` for requests that cannot be served)."""
        self.stats = EngineStats()
        start = time.perf_counter()
        outputs = [self.submit(request, **defaults) for request in requests]
        total = sum(request.max_new_tokens for request, _ in self._waiting)
        bar, shown = _progress(total, progress), 0
        while self.has_unfinished():
            self.step()
            if bar is not None:  # progress counted only when shown: the loop is the engine's hot path
                done = sum(len(o.output_ids) for o in outputs)
                bar.update(done - shown)
                shown = done
        if bar is not None:
            bar.close()
        self.stats.seconds = time.perf_counter() - start
        self.stats.generated_tokens = sum(len(o.output_ids) for o in outputs)
        phases = self.stats.phase_seconds
        phases["other"] = max(0.0, self.stats.seconds - phases["prefill"] - phases["draft"] - phases["verify"])
        return outputs

    # -- admission --------------------------------------------------------------------------------------------------

    def problem(self, request: Request) -> str | None:
        """Why `request` can never be served here (its token ids, sampling settings, context or memory), or None;
        `submit` refuses such a request, a server answers it before it reaches the engine."""
        input_ids, problem = _token_list(request.input_ids, self.vocab_size)
        return problem or self._problem(dataclasses.replace(request, input_ids=input_ids))

    def _problem(self, request: Request) -> str | None:
        """`problem` for a request whose token ids are already checked."""
        if not _is_int(request.max_new_tokens) or request.max_new_tokens < 1:
            return f"max_new_tokens must be a positive integer, got {request.max_new_tokens!r}"
        eos = request.eos_token_id
        if eos is not None and not all(_is_int(t) for t in _ids(eos)):
            return f"eos_token_id must be an integer or a list of integers, got {eos!r}"
        if request.do_sample:
            sampling_problem = _sampling_problem(request)
            if sampling_problem is not None:
                return sampling_problem
        if request.seed is not None and not _is_int(request.seed):
            return f"seed must be an integer, got {request.seed!r}"
        if request.reproducible and request.do_sample and request.seed is None:
            return "a reproducible sampled request needs a seed"
        length = len(request.input_ids) + request.max_new_tokens
        if self.context_limit is not None and length > self.context_limit:
            return (
                f"prompt ({len(request.input_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) needs {length} "
                f"positions, beyond the target's context of {self.context_limit}"
            )
        need = length + self.max_draft + 1
        if 2 * need * self.bytes_per_token > self.memory_budget_bytes:
            return (
                f"needs about {2 * need * self.bytes_per_token / 2**20:.0f} MiB of KV cache, more than the memory "
                f"budget of {self.memory_budget_bytes / 2**20:.0f} MiB"
            )
        return None

    def _fits(self, request: Request) -> bool:
        """Would the cache stay within budget with `request` admitted? Every row spans the widest row, and holes
        may double it before compaction."""
        rows = self.rows + [None]
        need = [len(r.request.input_ids) + r.request.max_new_tokens for r in self.rows]
        need.append(len(request.input_ids) + request.max_new_tokens)
        width = 2 * (max(need) + self.max_draft + 1)
        return len(rows) * width * self.bytes_per_token <= self.memory_budget_bytes

    def _admit(self) -> None:
        """Prefill waiting requests while the batch has room, each on its own, then merge them into the batch."""
        joined = []
        while (
            self._waiting
            and len(self.rows) < self.max_batch_size
            and (not self.rows or self._fits(self._waiting[0][0]))
        ):
            request, output = self._waiting.popleft()
            try:
                row, cache = self._prefill(request, output)
            except Exception as error:  # noqa: BLE001  (this request alone fails; reported on its output)
                _fail(output, error)
                continue
            if row.output.finish_reason is None:  # else done at its first token
                joined.append(cache)
                self.rows.append(row)
        if joined:
            self.cache.append_rows(*joined)  # one copy of the batch cache for all who joined this round
            if self.draft_state is not None:
                self.draft_state.add_rows(len(joined))

    def _fail_running(self, error: Exception) -> None:
        """A shared forward failed: every running row finishes with the error; both caches start afresh."""
        for row in self.rows:
            _fail(row.output, error)
        self.rows = []
        self.cache = RaggedCache(0, self.device)
        self.draft_state = self.drafter.new_draft_state(0) if self.drafter is not None else None

    def _prefill(self, request: Request, output: RequestOutput):
        start = time.perf_counter()
        eos = set(_ids(request.eos_token_id) if request.eos_token_id is not None else self.default_eos)
        generator = None
        if request.do_sample:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(int(request.seed) if request.seed is not None else torch.seed())
        policy_row = self.session.new_row() if self.session is not None else None
        row = _Row(
            request,
            output,
            eos,
            _processors(_sampling_settings(request)),
            generator,
            next_token=-1,
            policy_row=policy_row,
        )
        prompt = tuple(request.input_ids)
        kept = self.prompt_prefills.get(prompt) if self.prompt_prefills is not None else None
        if kept is None:
            cache = RaggedCache(1, self.device)
            ids = torch.tensor([request.input_ids], device=self.device)
            cache.append(torch.ones_like(ids, dtype=torch.bool))
            with self.taps.capturing():
                out = self.target(
                    input_ids=ids,
                    attention_mask=cache.valid.long(),
                    **with_cache(cache.cache),
                    use_cache=True,
                    logits_to_keep=1,
                    **self.taps.forward_kwargs(),
                )
            logits = out.logits[0, -1:].float()
            hidden = tuple(state[0] for state in self.taps.states(out)) if self.drafter is not None else None
            if self.prompt_prefills is not None:
                self.prompt_prefills.put(prompt, cache, logits, hidden)
        else:
            cache, logits, hidden = kept
            self.stats.reused_prefills += 1
        token = int(self._sample(row, logits.clone())[0])
        row.next_token = token
        if self.drafter is not None:
            row.pending_hidden = [hidden]
            row.pending_tokens = list(request.input_ids[1:]) + [token]
        row.emit([token])
        self.stats.phase_seconds["prefill"] += time.perf_counter() - start
        return row, cache

    # -- one round ----------------------------------------------------------------------------------------------------

    def _round(self) -> tuple[float, float]:
        """One draft-verify round; returns its seconds in the target forward and in drafting."""
        self.stats.rounds += 1
        self.stats.peak_rows = max(self.stats.peak_rows, len(self.rows))
        drafts, draft_logits, drafting = self._draft()
        depths = self._depths(drafts, drafting)
        forward = self._verify(drafts, draft_logits, drafting, depths)
        return forward, drafting.seconds if drafting is not None else 0.0

    def _draft(self) -> tuple[torch.LongTensor, torch.Tensor | None, DraftRound | None]:
        """Every row's drafts [B, K] (target vocabulary), their draft logits and the `DraftRound` that chose them;
        K = 0 without a drafter, or when the policy skips drafting this round (the verified tokens then wait: the
        drafter reads them all at once when it next drafts)."""
        batch = len(self.rows)
        no_drafts = torch.zeros(batch, 0, dtype=torch.long, device=self.device), None, None
        if self.drafter is None or self._drafting_paused():
            return no_drafts
        try:
            return self._draft_all(no_drafts)
        except Exception as error:  # noqa: BLE001  (the rows lose their drafts, never their outputs)
            self._rows_without_drafts = {id(row.output) for row in self.rows}
            logger.warning(
                f"The drafter failed while drafting ({type(error).__name__}: {error}); the {batch} requests running "
                "decode on without drafts (their outputs are unchanged), later ones draft again"
            )
            return no_drafts

    def _drafting_paused(self) -> bool:
        """After a drafting failure the drafter's state of the rows then running cannot be trusted: they decode on
        without drafts. Once they have all left, the drafter starts afresh: the rows that joined since never drafted,
        so their backlog (`pending_tokens`) holds their whole text, which it reads at its next round."""
        if self._rows_without_drafts is None:
            return False
        if any(id(row.output) in self._rows_without_drafts for row in self.rows):
            return True
        self._rows_without_drafts = None
        self.draft_state = self.drafter.new_draft_state(len(self.rows))
        return False

    def _draft_all(self, no_drafts):
        tokens_left = [row.remaining - 1 for row in self.rows]
        budget = max(tokens_left)
        count = self.session.draft_count(
            self.draft_state,
            [row.policy_row for row in self.rows],
            budget,
            [row.pending_tokens for row in self.rows],
            tokens_left=tokens_left,
        )
        if count == 0:
            self.stats.skipped_drafts += budget > 0
            return no_drafts
        tokens, lengths, hidden = pad_pending(
            [row.pending_tokens for row in self.rows],
            [row.pending_hidden for row in self.rows],
            len(self.taps.indices),
            self.device,
        )
        draft_ids, logits, drafting = self.session.draft_round(
            self.draft_state,
            [row.policy_row for row in self.rows],
            hidden,
            tokens,
            count,
            temperatures=torch.tensor(
                [row.request.temperature if row.request.do_sample else 1.0 for row in self.rows]
            ),
            sampled=[row.request.do_sample for row in self.rows],
            generators=[row.generator for row in self.rows],
            new_lengths=lengths,
        )
        for row in self.rows:
            row.pending_hidden, row.pending_tokens = [], []
        self.stats.phase_seconds["draft"] += drafting.seconds
        self.stats.drafting.add_drafting_time(drafting)
        return draft_ids, logits, drafting

    def _depths(self, drafts: torch.Tensor, drafting: DraftRound | None) -> list[int]:
        """Drafted tokens to verify per row, as the policy decides; never past a row's length limit, nor from a step
        whose draft scores were not finite."""
        if drafting is None or not drafts.shape[1]:
            return [0] * len(self.rows)
        usable = drafting.usable_steps()
        caps = [max(0, min(drafts.shape[1], row.remaining - 1, usable[r])) for r, row in enumerate(self.rows)]
        return self.session.depths(drafting, caps, [row.policy_row for row in self.rows])

    def _verify(self, drafts, draft_logits, drafting: DraftRound | None, depths: list[int]) -> float:
        """One target forward over every row's [next token, kept drafts]; accept per row; update both caches.
        Returns the forward's seconds."""
        start = time.perf_counter()
        width = 1 + max(depths)
        chunk = torch.zeros(len(self.rows), width, dtype=torch.long, device=self.device)
        for r, row in enumerate(self.rows):
            chunk[r, 0] = row.next_token
            chunk[r, 1 : 1 + depths[r]] = drafts[r, : depths[r]]
        positions = self.cache.position_ids(width)
        self.cache.append(
            torch.arange(width, device=self.device)[None, :] < torch.tensor(depths, device=self.device)[:, None] + 1
        )
        forward_start = device_clock(self.device)
        with self.taps.capturing():
            out = self.target(
                input_ids=chunk,
                position_ids=positions,
                attention_mask=self.cache.target_attention_mask(width, self.sliding_windows, self.target.dtype),
                **with_cache(self.cache.cache),
                use_cache=True,
                **self.taps.forward_kwargs(),
            )
        forward = device_clock(self.device) - forward_start
        hidden = self.taps.states(out)
        if self.session is not None:
            self.session.observe_forward(len(self.rows), width, forward)
        keep = torch.zeros(len(self.rows), width, dtype=torch.bool, device=self.device)
        observed, accepted_counts = (
            list(depths),
            [0] * len(self.rows),
        )  # what the policy learns from (failed rows: nothing)
        # the target's choice at every position when a row decodes greedily, one call for all rows (max's indices are
        # the argmax, the first of a tie too, in a third to a fifth of argmax's time over a 49k vocabulary on a CPU)
        greedy = out.logits.max(-1).indices.tolist() if any(not row.request.do_sample for row in self.rows) else None
        undrafted = self._draw_undrafted(out.logits, depths)
        for r, row in enumerate(self.rows):
            depth = depths[r]
            try:
                if r in undrafted:
                    accepted, bonus = 0, undrafted[r]
                elif row.request.do_sample and row.request.reproducible:
                    accepted, bonus = self._accept_seeded(
                        row, out.logits[r, : depth + 1].float(), chunk[r, 1 : depth + 1]
                    )
                elif row.request.do_sample:
                    q = None
                    if depth:
                        q = (
                            self.drafter.to_target_logits(draft_logits[r, :depth].float()) / row.request.temperature
                        ).softmax(-1)
                    accepted, bonus = self._accept_sampled(
                        row, out.logits[r, : depth + 1].float(), chunk[r, 1 : depth + 1], q
                    )
                else:  # drafts are accepted while they equal the target's argmax
                    drafted = chunk[r, 1 : depth + 1].tolist()
                    accepted = next((k for k in range(depth) if drafted[k] != greedy[r][k]), depth)
                    bonus = greedy[r][accepted]
            except Exception as error:  # noqa: BLE001  (this request alone fails; it leaves the batch at retire)
                _fail(row.output, error)
                observed[r] = 0
                continue
            accepted_counts[r] = accepted
            keep[r, : accepted + 1] = True
            new_tokens = chunk[r, 1 : accepted + 1].tolist() + [bonus]
            row.output.stats.record_round(drafted=depth, accepted=accepted)
            row.emit(new_tokens)
            row.next_token = bonus
            if self.drafter is not None:  # appended: a round without drafting leaves the earlier ones unread
                row.pending_hidden.append(tuple(state[r, : accepted + 1] for state in hidden))
                row.pending_tokens.extend(new_tokens)
        self.cache.keep_last(keep)
        if drafting is not None:
            self.session.observe(
                self.draft_state, drafting, observed, accepted_counts, [row.policy_row for row in self.rows]
            )
        self.stats.phase_seconds["verify"] += time.perf_counter() - start
        return forward

    def _draw_undrafted(self, logits: torch.Tensor, depths: list[int]) -> dict[int, int]:
        """The token of each sampled row (not `reproducible`) that verified no draft, by row: drawn from its target
        distribution at its one position with its own generator, as `_accept_sampled` does, the rows of one sampling
        setting in one softmax and one CDF (one row alone costs about 0.3 ms over a 49k vocabulary on a CPU, and
        regeneration samples 48 rows a step). A group whose draw fails is left to the rows' own path, which reports
        a failure on its row alone."""
        groups = defaultdict(list)
        for r, row in enumerate(self.rows):
            if not depths[r] and row.request.do_sample and not row.request.reproducible:
                groups[_sampling_settings(row.request)].append(r)
        tokens = {}
        for members in groups.values():
            try:
                scores = logits[torch.tensor(members, device=logits.device), 0].float()
                p = self.rows[members[0]].processors(NO_IDS, scores).softmax(-1)
                tokens.update(zip(members, draw_rows(p, [self.rows[r].generator for r in members])))
            except Exception:  # noqa: BLE001  (the rows' own path draws again and reports on the failing row)
                continue
        return tokens

    def _accept_sampled(
        self, row: _Row, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None
    ) -> tuple[int, int]:
        """How many of `drafts` the target accepts, and the token it emits after them, by speculative rejection
        sampling: accept x with probability min(1, p(x)/q(x)); on rejection draw from norm(max(p - q, 0)). The
        output is distributed exactly as the target's."""
        p = self._probabilities(row, logits)
        for k, token in enumerate(drafts.tolist()):
            ratio = p[k, token] / q[k, token].clamp_min(1e-30)
            if torch.rand((), generator=row.generator, device=self.device) >= ratio:
                residual = (p[k] - q[k]).clamp_min(0)
                total = residual.sum()
                residual = residual / total if total > 0 else p[k]
                return k, draw(residual, row.generator)
        return len(drafts), draw(p[len(drafts)], row.generator)

    def _accept_seeded(self, row: _Row, logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
        """A reproducible request's drafts against its own samples: the token at each position is
        `seeded_sample(p, seed, position)`; drafts are accepted while equal to it, then that sample follows."""
        p = self._probabilities(row, logits)
        start, seed = len(row.output.output_ids), row.request.seed
        for k, token in enumerate(drafts.tolist()):
            sample = seeded_sample(p[k], seed, start + k)
            if token != sample:
                return k, sample
        return len(drafts), seeded_sample(p[len(drafts)], seed, start + len(drafts))

    def _probabilities(self, row: _Row, logits: torch.Tensor) -> torch.Tensor:
        """The target's sampling distribution at each position after the request's temperature / top-k / top-p."""
        return row.processors(NO_IDS, logits).softmax(-1)

    def _sample(self, row: _Row, logits: torch.Tensor) -> torch.LongTensor:
        if not row.request.do_sample:
            return logits.max(-1).indices
        p = self._probabilities(row, logits)
        if row.request.reproducible:
            position = len(row.output.output_ids)
            return torch.tensor([seeded_sample(p[0], row.request.seed, position)], device=self.device)
        return torch.tensor([draw(row_p, row.generator) for row_p in p], device=self.device)

    # -- bookkeeping --------------------------------------------------------------------------------------------------

    def _retire(self) -> None:
        """Finished rows leave the batch (and both caches); holes are squeezed out when they waste half the cache."""
        keep = [r for r, row in enumerate(self.rows) if row.output.finish_reason is None]
        if self.drafter is not None:
            for row in self.rows:
                if row.output.finish_reason in ("eos", "length"):  # a whole answer, not a cut-off or failed one
                    self.drafter.record_output(row.output.output_ids)
        if len(keep) < len(self.rows):
            keep = fewest_moves(keep)  # the rows' order is free: the caches move one row per leaver
            rows = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.cache.select_rows(rows)
            if self.draft_state is not None:
                self.draft_state.select_rows(rows)
            self.rows = [self.rows[r] for r in keep]
        self.cache.compact(max_waste=COMPACT_AT)
        if self.draft_state is not None:
            self.draft_state.compact()

    def _record_memory(self) -> None:
        held = self.cache.nbytes() + (self.draft_state.nbytes() if self.draft_state is not None else 0)
        self.stats.peak_cache_bytes = max(self.stats.peak_cache_bytes, held)
        self.stats.peak_rss_bytes = max(self.stats.peak_rss_bytes, resident_memory_bytes(self.device))


def seeded_sample(probabilities: torch.Tensor, seed: int, position: int) -> int:
    """A sample of `probabilities` drawn from (`seed`, `position`) alone: argmax p(x) / E(x) with E(x) ~ Exp(1)
    seeded by both (the exponential race, i.e. the Gumbel-max trick). The noise of each position is independent of
    every other's, so a text sampled token by token this way follows the target's law exactly."""
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=probabilities.device)
    generator.manual_seed(int.from_bytes(key, "little") >> 1)
    race = torch.empty_like(probabilities, dtype=torch.float64).exponential_(generator=generator)
    return int((probabilities.double() / race).argmax())


def _is_int(value) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _ids(ids) -> list:
    """An int, list, tuple or tensor of token ids as a list."""
    if isinstance(ids, torch.Tensor):
        return ids.flatten().tolist()
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def _token_list(ids, vocab_size: int) -> tuple[list[int], str | None]:
    """Token ids given as an int, a list/tuple, a numpy array or a tensor (1-D, or one row) as a list of ints, and
    what is wrong with them."""
    if isinstance(ids, (np.ndarray, np.generic)):
        ids = torch.from_numpy(np.asarray(ids))
    if isinstance(ids, torch.Tensor):
        if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1) or ids.is_floating_point() or ids.is_complex():
            return (
                [],
                f"token ids must be integers in a 1-D tensor or a single row, got a {ids.dtype} tensor of shape {tuple(ids.shape)}",
            )
    elif not _is_int(ids) and not isinstance(ids, (list, tuple)):
        return [], f"token ids must be a list or tensor of integers, got {type(ids).__name__}"
    ids = _ids(ids)
    bad = next((t for t in ids if not _is_int(t) or not 0 <= t < vocab_size), None)
    if bad is not None:
        return [], f"token id {bad!r} is not an integer in the vocabulary [0, {vocab_size})"
    if not ids:
        return [], "empty prompt: decoding needs at least one input token"
    return [int(token) for token in ids], None


def _sampling_problem(request: Request) -> str | None:
    """What is wrong with a sampling request's settings, or None."""
    temperature, top_k, top_p = request.temperature, request.top_k, request.top_p
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not 0 < temperature < float("inf")
    ):
        return f"temperature must be a positive finite number when sampling, got {temperature!r}"
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        return f"top_k must be a non-negative integer (0 or None: off), got {top_k!r}"
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        return f"top_p must be in (0, 1], got {top_p!r}"
    return None


def _fail(output: RequestOutput, error: Exception) -> None:
    """Finish a request with an error that happened while serving it (and warn, so it is never silent)."""
    output.finish_reason, output.error = (
        "error",
        f"request {output.request_id!r} failed: {type(error).__name__}: {error}",
    )
    logger.warning(output.error)


COMPACT_AT = 0.2
"""The batch cache is compacted once its holes are this share of its columns: every forward attends over all of
them, and a column of holes read at every step costs more within a few steps than one copy of the kept columns
(regeneration, 48 rows: a mean width of 264 columns over rows 129 tokens long at 0.5, 206 at 0.2;
benchmarks/issue36/regen_share)."""

NO_IDS = torch.empty(1, 0, dtype=torch.long)
"""What `_processors`' warpers get for the ids so far: they read only the scores (no penalty that looks back)."""


def _sampling_settings(request: Request) -> tuple | None:
    """All that a request's warpers read: (temperature, top-k, top-p) when it samples, else None. Rows of one
    setting share their warpers' work (`_draw_undrafted`), so `_processors` builds them from this alone."""
    return (request.temperature, request.top_k, request.top_p) if request.do_sample else None


def _processors(settings: tuple | None) -> LogitsProcessorList:
    """The temperature, top-k and top-p warpers of `_sampling_settings`: each reads only the scores it is given,
    so one list serves any rows of the same settings at once."""
    processors = LogitsProcessorList()
    if settings is not None:
        temperature, top_k, top_p = settings
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
    return processors


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from transformers.utils.logging import tqdm  # honours transformers.utils.logging.disable_progress_bar()

    return tqdm(total=total, desc="engine", unit="tok")
