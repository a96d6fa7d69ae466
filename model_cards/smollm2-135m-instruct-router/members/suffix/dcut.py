"""D-cut (AngelSpec §4): verify only as deep as it pays off on this hardware.

Every drafted token gets a confidence, the prefix product of the draft probabilities up to it (an estimate of the
chance that the whole prefix is accepted), calibrated online against what verification actually accepts. The
drafted tokens of all requests are ranked together by confidence, and the verified set S is the prefix of that
ranking that maximises expected tokens per second of the round:

    S* = argmax_S  (R + Σ_{(r,k) ∈ S} c_rk) / (t_draft + t_verify(R, 1 + max_r n_r(S)))

R requests each keep their bonus token; n_r(S) is request r's verified depth; t_verify is the target's verify
forward latency profiled on this machine (`VerifyCostModel`). A single `generate()` call is the case R = 1.
Written here because no library ships it: transformers' schedules (`constant`, `heuristic`, confidence threshold)
set one depth per sequence without a cost model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.utils.logging import tqdm  # honours transformers.utils.logging.disable_progress_bar()

from .timing import device_clock


PROFILED_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MAX_VERIFY_SECONDS = 600.0  # a profiled forward slower than this is a corrupt profile, not a measurement


def machine_description(target) -> dict:
    """What a latency profile depends on: the target's shape and precision, the device, threads, torch, and the
    linear-kernel plan its layers follow (`kernels.tune_linear_kernels`; "default": none)."""
    from .kernels import installed_plan

    config = target.config.get_text_config()
    plan = installed_plan(target)
    return {
        "target": getattr(config, "_name_or_path", "") or config.model_type,
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "dtype": str(target.dtype),
        "device": str(target.device),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "linear_kernels": plan.fingerprint() if plan is not None else "default",
    }


@dataclass
class VerifyCostModel:
    """Latency of one target verify forward: `seconds[i][j]` for `rows[i]` rows of `tokens[j]` new tokens each,
    over a KV cache of `context` tokens; interpolated linearly in between, extrapolated linearly beyond."""

    rows: list[int]
    tokens: list[int]
    seconds: list[list[float]]
    context: int
    machine: dict = field(default_factory=dict)

    def __post_init__(self):
        self._memo: dict[tuple[int, int], float] = {}  # asked each round for the same few shapes: computed once

    def __call__(self, rows: int, tokens_per_row: int) -> float:
        key = (rows, tokens_per_row)
        if key not in self._memo:
            per_row = [_interpolate(self.tokens, line, tokens_per_row) for line in self.seconds]
            self._memo[key] = _interpolate(self.rows, per_row, rows)
        return self._memo[key]

    def save(self, path: str) -> None:
        """Write atomically: a reader never sees a half-written profile."""
        write_json_atomically(path, asdict(self))

    @classmethod
    def load(cls, path: str) -> "VerifyCostModel":
        with open(path) as stream:
            data = json.load(stream)
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a verify-cost profile (a JSON object)")
        model = cls(**data)
        problem = model.problem()
        if problem is not None:
            raise ValueError(f"{path} is not a valid verify-cost profile: {problem}")
        return model

    def problem(self) -> str | None:
        """What makes this profile unusable, or None: rows and tokens must be increasing positive integers, and
        every latency a positive finite number of seconds below `MAX_VERIFY_SECONDS`."""
        for name, values in (("rows", self.rows), ("tokens", self.tokens)):
            problem = _counts_problem(name, values)
            if problem is not None:
                return problem
        if (
            not isinstance(self.seconds, list)
            or len(self.seconds) != len(self.rows)
            or not all(isinstance(line, list) and len(line) == len(self.tokens) for line in self.seconds)
        ):
            return f"seconds must be {len(self.rows)} lists of {len(self.tokens)} latencies (rows × tokens)"
        bad = next(
            (v for line in self.seconds for v in line if not _is_number(v) or not 0 < v <= MAX_VERIFY_SECONDS), None
        )
        if bad is not None:
            return f"latency {bad!r} is not a number of seconds in (0, {MAX_VERIFY_SECONDS:g}]"
        return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _counts_problem(name: str, values) -> str | None:
    """Why `values` is not a non-empty increasing list of positive integers, or None."""
    if not isinstance(values, (list, tuple)) or not values:
        return f"{name} must be a non-empty list of positive integers, got {values!r}"
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return f"{name} must be positive integers, got {list(values)}"
    if any(b <= a for a, b in zip(values, values[1:])):
        return f"{name} must be increasing, got {list(values)}"
    return None


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys): flat below the first point, extended along the last segment beyond the
    last one (proportionally when there is a single point)."""
    if x <= xs[0]:
        return ys[0]
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    index = next((i for i in range(1, len(xs)) if x <= xs[i]), len(xs) - 1)
    x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), min(ys))


@torch.no_grad()
def profile_verify_cost(
    target,
    rows: Sequence[int] = (1,),
    tokens: Sequence[int] = PROFILED_TOKENS,
    context: int = 128,
    repeats: int = 5,
    progress: bool = True,
) -> VerifyCostModel:
    """Time target forwards of `rows` × `tokens` new tokens over a `context`-token KV cache (median of `repeats`).
    The token counts of a row count take turns within each repeat, so a burst of load on a shared machine lands on
    one repeat of each rather than on all repeats of one."""
    rows, tokens = sorted(set(rows)), sorted(set(tokens))
    for name, values in (("rows", rows), ("tokens", tokens)):
        problem = _counts_problem(name, values)
        if problem is not None:
            raise ValueError(problem)
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(context, int) or context < 1:
        raise ValueError(
            f"repeats and context must be positive integers, got repeats={repeats!r}, context={context!r}"
        )
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    seconds = []
    bar = tqdm(total=len(rows) * (repeats + 1), desc="profiling verify cost", disable=not progress)
    for batch in rows:
        prompt = torch.randint(vocab, (batch, context), generator=generator).to(target.device)
        cache = DynamicCache()
        target(input_ids=prompt, past_key_values=cache, use_cache=True)
        inputs = [
            (
                torch.randint(vocab, (batch, count), generator=generator).to(target.device),
                torch.arange(context, context + count, device=target.device).expand(batch, -1),
            )
            for count in tokens
        ]
        timings = [[] for _ in tokens]
        for repeat in range(repeats + 1):  # the first round warms up
            for (new, positions), times in zip(inputs, timings):
                start = device_clock(target.device)
                target(input_ids=new, position_ids=positions, past_key_values=cache, use_cache=True)
                if repeat:
                    times.append(device_clock(target.device) - start)
                cache.crop(-new.shape[1])
            bar.update()
        seconds.append([sorted(times)[len(times) // 2] for times in timings])
    bar.close()
    return VerifyCostModel(list(rows), list(tokens), seconds, context, machine_description(target))


def cache_path(kind: str, target) -> str:
    """Where a measurement of `kind` of `target` on this machine is cached (`$ANGELSPEC_CACHE`, default
    ~/.cache/angelspec_hf), keyed by `machine_description`."""
    root = os.environ.get("ANGELSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "angelspec_hf")
    key = hashlib.sha1(json.dumps(machine_description(target), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(root, kind, f"{key}.json")


def write_json_atomically(path: str, data) -> None:
    """Write `data` as JSON through a temporary file renamed over `path`: a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(handle, "w") as stream:
        json.dump(data, stream, indent=1)
    os.replace(temporary, path)


def read_cached(path: str, load: Callable, what: str):
    """`load(path)` of a cached measurement; None when nothing is cached there, or, with a warning, when what is
    there is unreadable or invalid (then it is measured again)."""
    if not os.path.exists(path):
        return None
    try:
        return load(path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        warnings.warn(f"{what} {path} is unreadable ({error}); measuring this machine again.")
        return None


def keep_cached(path: str, measurement, what: str) -> None:
    """`measurement.save(path)`; a cache folder that cannot be written is warned about, and the measurement is
    used without saving it."""
    try:
        measurement.save(path)
    except OSError as error:
        warnings.warn(f"Could not cache the {what} at {path} ({error}); using it without saving.")


def cost_model_path(target) -> str:
    """Where the verify-cost profile of `target` on this machine is cached."""
    return cache_path("verify_cost", target)


_LOADED: dict[str, VerifyCostModel] = {}


def load_cost_model(target, path: str | None = None, rows: Sequence[int] = (1,)) -> VerifyCostModel:
    """The cached profile of `target` on this machine; profiled (with a progress bar) and cached when missing,
    or, with a warning, when the cache is unreadable, holds invalid values, or lacks the batch sizes asked for. A
    cache folder that cannot be written is warned about, and the measured profile is used without saving it."""
    path = path or cost_model_path(target)
    if path in _LOADED and set(rows) <= set(_LOADED[path].rows):
        return _LOADED[path]
    model = read_cached(path, VerifyCostModel.load, "Verify-cost profile")
    if model is None or not set(rows) <= set(model.rows):
        model = profile_verify_cost(target, rows=sorted(set(rows) | set(model.rows if model else ())))
        keep_cached(path, model, "verify-cost profile")
    _LOADED[path] = model
    return model


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


_warned_non_finite = False


class _DraftSteps:
    """Timing and D-cut's early exit over the steps drafted so far, for a `DraftRound` or a share of its rows."""

    start: float
    finished_at: list[float]
    max_steps: int | None = None  # the most steps the drafter of these rows takes, when below the round's (a member's)

    def confidence(self) -> torch.Tensor:
        raise NotImplementedError

    def step_seconds(self, previous: float) -> float:
        """Mean time of a drafting step after the first (`previous` until two steps are measured)."""
        if len(self.finished_at) < 2:
            return previous
        return (self.finished_at[-1] - self.finished_at[0]) / (len(self.finished_at) - 1)

    def first_step_seconds(self) -> float:
        """Time to the first drafted token: the drafter reading the verified tokens, and its first step."""
        return (self.finished_at[0] if self.finished_at else time.perf_counter()) - self.start

    def row_sources(self) -> torch.LongTensor:
        """Which source (the router's member; 0 for a single drafter) drafts each of these rows, [rows, 1]."""
        raise NotImplementedError

    def worth_continuing(self, calibrator, verify_seconds, max_draft: int, step_seconds: float) -> bool:
        """D-cut's early exit after a step (`worth_drafting_further` on the calibrated confidences so far), weighing
        no more further steps than the drafter of these rows can take."""
        confidences = list(calibrator(self.confidence(), self.row_sources()))
        most = max_draft if self.max_steps is None else min(max_draft, self.max_steps)
        return worth_drafting_further(
            confidences, verify_seconds, most, time.perf_counter() - self.start, step_seconds
        )


class DraftRound(_DraftSteps):
    """One round of sequential drafting, shared by `generate()`'s candidate generator and the batched engine: picks
    each row's token from the draft logits (argmax, or a draw from q = softmax(logits / T)), and records what the
    verify policy needs — each step's confidence inputs, which steps had usable (finite) scores, and timing. It is
    the `choose` a drafter's `propose` calls; `keep_drafting()` asks the verify policy whether to draft on.

    Confidence of step k (`confidence()`): c_k = Π_{j<k} q_j(x_j) · m_k, where m_k is known before x_k is drawn:
    max q_k for a greedy row (so c_k is the prefix product Π_{j≤k} q_j(x_j) of §4), E_{x~q_k}[q_k(x)] = Σ q_k² for
    a sampled row. Rejection sampling is exact only if whether x_k is verified does not depend on x_k itself, so a
    sampled row's confidence at k must not read x_k (`dcut_depths` also decides such rows position by position).
    A row whose draft scores turn non-finite (a broken drafter) drafts nothing usable from that step on. A drafter
    that drafts some rows apart from the others (the router's members) picks them through `rows(...)`, and names
    each row's member in `sources` so that D-cut calibrates each member's confidences apart; a row that drafts fewer
    steps than others has no usable score at the steps it did not draft.
    """

    def __init__(
        self,
        temperatures: torch.Tensor,
        sampled: Sequence[bool],
        generators=None,
        read_width: int = 1,
        reads_backlog: bool = False,
        keep_drafting_rule: Callable[["_DraftSteps"], bool] | None = None,
    ):
        self.start = time.perf_counter()
        self.seconds = 0.0  # the whole round's drafting time, once it is over
        self.read_width = read_width  # verified tokens per row the drafter read first (padded to the row with most)
        self.reads_backlog = reads_backlog  # the drafter first read more than a round's verified tokens
        self.sampled = torch.tensor(list(sampled), dtype=torch.bool)
        self.temperatures = temperatures
        self.generators = generators if generators is not None else [None] * len(self.sampled)
        self.keep_drafting_rule = keep_drafting_rule  # the verify policy's early exit, for these steps or a share
        self.row_steps = [0] * len(self.sampled)  # steps drafted so far, per row
        self.probabilities: list[torch.Tensor] = []  # q_k(x_k) per row
        self.known_before: list[torch.Tensor] = []  # m_k per row
        self.usable: list[torch.Tensor] = []  # finite scores up to and including step k, per row
        self.finished_at: list[float] = []
        self.sources = torch.zeros(len(self.sampled), dtype=torch.long)  # each row's drafting member (router)

    def __call__(self, logits: torch.Tensor) -> torch.LongTensor:
        return self.choose(logits)

    def row_sources(self) -> torch.LongTensor:
        return self.sources[:, None]

    def choose(self, logits: torch.Tensor, rows: Sequence[int] | None = None) -> torch.LongTensor:
        """The drafted token of each row (of `rows`, all by default; they must be at the same step) from its
        draft-vocabulary logits [rows, V]."""
        index = list(range(len(self.sampled))) if rows is None else list(rows)
        step = self.row_steps[index[0]]
        if any(self.row_steps[row] != step for row in index):
            raise ValueError("Rows drafted together must be at the same drafting step")
        probabilities = (logits.float() / self.temperatures[index, None].to(logits.device)).softmax(-1)
        finite = torch.isfinite(probabilities).all(-1).cpu()
        if not bool(finite.all()):
            _warn_non_finite()
            probabilities = torch.where(
                finite[:, None].to(probabilities.device), probabilities, 1.0 / probabilities.shape[-1]
            )
        token = logits.argmax(-1)
        sampled = self.sampled[index]
        for position in sampled.nonzero()[:, 0].tolist():
            generator = self.generators[index[position]]
            token[position] = torch.multinomial(probabilities[position], 1, generator=generator)[0]
        chosen = probabilities.gather(-1, token[:, None])[:, 0].cpu()
        known = torch.where(sampled, probabilities.square().sum(-1).cpu(), probabilities.max(-1).values.cpu())
        if step == len(self.probabilities):  # the first rows to reach this step: nobody else has a score here yet
            batch = len(self.sampled)
            self.probabilities.append(torch.zeros(batch))
            self.known_before.append(torch.zeros(batch))
            self.usable.append(torch.zeros(batch, dtype=torch.bool))
            self.finished_at.append(0.0)
        where = torch.tensor(index)
        usable = finite & (self.usable[step - 1][where] if step else True)
        self.probabilities[step][where] = torch.where(usable, chosen, 0.0)
        self.known_before[step][where] = torch.where(usable, known, 0.0)
        self.usable[step][where] = usable
        self.finished_at[step] = time.perf_counter()
        for row in index:
            self.row_steps[row] += 1
        return token

    def rows(self, rows: Sequence[int]) -> "DraftRoundRows":
        """These rows of the round, drafted apart from the others."""
        return DraftRoundRows(self, rows)

    def keep_drafting(self) -> bool:
        return self.keep_drafting_rule is None or self.keep_drafting_rule(self)

    def chosen_probabilities(self) -> torch.Tensor:
        """The draft probabilities so far, [rows, steps], on the CPU."""
        return torch.stack(self.probabilities, 1)

    def confidence(self) -> torch.Tensor:
        """c_k = Π_{j<k} q_j(x_j) · m_k for the steps so far, [rows, steps] (see the class docstring)."""
        chosen, known = self.chosen_probabilities().double(), torch.stack(self.known_before, 1).double()
        before = torch.cat([torch.ones_like(chosen[:, :1]), chosen[:, :-1]], 1).cumprod(-1)
        return before * known

    def usable_steps(self) -> list[int]:
        """Per row, how many leading steps had finite draft scores (only those may be verified)."""
        if not self.usable:
            return [0] * len(self.sampled)
        return torch.stack(self.usable, 1).long().cumprod(-1).sum(-1).tolist()


class DraftRoundRows(_DraftSteps):
    """A share of a `DraftRound`'s rows that one drafter drafts apart from the others (a router member's rows): a
    `choose` for them alone, recording into the round, and the policy's early exit judged on them alone."""

    def __init__(self, round: DraftRound, rows: Sequence[int]):
        self.round, self.row_index = round, list(rows)
        self.start = time.perf_counter()
        self.finished_at: list[float] = []

    def __call__(self, logits: torch.Tensor) -> torch.LongTensor:
        token = self.round.choose(logits, self.row_index)
        self.finished_at.append(time.perf_counter())
        return token

    def confidence(self) -> torch.Tensor:
        return self.round.confidence()[self.row_index, : len(self.finished_at)]

    def row_sources(self) -> torch.LongTensor:
        return self.round.sources[self.row_index, None]

    def keep_drafting(self) -> bool:
        return self.round.keep_drafting_rule is None or self.round.keep_drafting_rule(self)


def _warn_non_finite() -> None:
    global _warned_non_finite
    if not _warned_non_finite:
        _warned_non_finite = True
        warnings.warn(
            "The drafter produced non-finite scores (NaN or inf): those drafts are not verified, and the target's "
            "own tokens are emitted instead (shown once).",
            RuntimeWarning,
            stacklevel=3,
        )


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
