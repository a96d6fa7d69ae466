"""The verify-cost profile D-cut plans with (AngelSpec §4): the target's verify-forward latency on this machine for
each batch size and tokens per row, measured once and cached (`measurements`, keyed by the machine and its
linear-kernel plan). Verifying more tokens, or more rows, never costs less: the profile D-cut plans with is the
measured medians' closest fit that never decreases (`monotone_fit`), so that one noisy width (a burst of load, a
kernel switch between 2 and 4 tokens) does not become a width D-cut prefers; the medians are kept beside it."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol, Sequence

import torch
from transformers import Cache, DynamicCache
from transformers.utils.logging import tqdm  # honours transformers.utils.logging.disable_progress_bar()

from ..cache_utils import with_cache
from .measurements import cache_path, machine_description, read_or_measure, write_json_atomically
from .timing import device_clock


PROFILED_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MAX_VERIFY_SECONDS = 600.0  # a profiled forward slower than this is a corrupt profile, not a measurement


class VerifyCost(Protocol):
    """What a verify policy prices with: the seconds of one verify forward of `rows` rows, `width` new tokens each (a
    profile, `VerifyCostModel`, or a run's correction of one, `CorrectedCost`)."""

    def __call__(self, rows: int, width: int, /) -> float: ...


@dataclass
class VerifyCostModel:
    """Latency of one target verify forward: `seconds[i][j]` for `rows[i]` rows of `tokens[j]` new tokens each,
    over a KV cache of `context` tokens; interpolated linearly in between, extrapolated linearly beyond."""

    rows: list[int]
    tokens: list[int]
    seconds: list[list[float]]
    context: int
    machine: dict = field(default_factory=dict)
    measured: list[list[float]] | None = None  # the medians `seconds` was fitted to, when profiled

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


class CorrectedCost:
    """The profile as this run finds it: each verify forward the run times (`observe`) moves a running ratio of
    measured to profiled seconds for its (rows, width) cell, and the cost D-cut plans with is the profile times the
    ratio of the cell, or of the nearest cell measured (the same batch size first), 1 before any. The profile is
    measured over a `context`-token cache with every row equally long; a served batch reads longer, ragged caches:
    on this 2-core Xeon, 16 requests of a chat/math/code mix took 1.25x the profile at width 1 and 1.4x at widths
    5-9, so the cut, planning with the profile, verified where it lost (0.75x batched AR). A cost never falls
    with the width (the measured cells below a width bound it)."""

    def __init__(self, profile: VerifyCostModel, weight: float = 0.1, bounds: tuple[float, float] = (0.5, 2.0)):
        self.profile, self.weight, self.bounds = profile, weight, bounds
        self.ratios: dict[int, dict[int, float]] = {}  # rows -> width -> ratio

    @classmethod
    def of(cls, cost: "VerifyCostModel | CorrectedCost") -> "CorrectedCost":
        """`cost` as a run plans with it: a profile corrected from here on, a corrected cost as it is."""
        return cost if isinstance(cost, cls) else cls(cost)

    def __call__(self, rows: int, width: int) -> float:
        measured = self.ratios.get(rows, {})
        seconds = self.profile(rows, width) * self.ratio(rows, width)
        return max([seconds] + [self.profile(rows, w) * r for w, r in measured.items() if w < width])

    def ratio(self, rows: int, width: int) -> float:
        """The measured-to-profiled ratio the cost of (rows, width) is read with."""
        if not self.ratios:
            return 1.0
        nearest_rows = rows if rows in self.ratios else min(self.ratios, key=lambda n: (abs(math.log(n / rows)), n))
        widths = self.ratios[nearest_rows]
        return widths[width] if width in widths else widths[min(widths, key=lambda w: (abs(w - width), w))]

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A verify forward of `rows` rows `width` tokens wide took `seconds`; one far off the profile (a stall) moves
        the ratio at most to its `bounds`."""
        if not (rows >= 1 and width >= 1 and math.isfinite(seconds) and seconds > 0):
            return
        measured = min(max(seconds / self.profile(rows, width), self.bounds[0]), self.bounds[1])
        widths = self.ratios.setdefault(rows, {})
        old = widths.get(width)
        widths[width] = measured if old is None else (1 - self.weight) * old + self.weight * measured


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


def monotone_fit(seconds: list[list[float]]) -> list[list[float]]:
    """The least-squares fit of a profile (`seconds[i][j]`: rows[i] × tokens[j]) that never decreases with tokens per
    row (pool-adjacent-violators along each row), then with rows (each row raised to the one before it where lower:
    the elementwise maximum of non-decreasing rows is non-decreasing)."""
    fitted = []
    for line in seconds:
        blocks: list[list[float]] = []  # [mean, count] of pooled neighbours, means increasing
        for value in line:
            blocks.append([value, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (mean, count), (last, size) = blocks[-2], blocks.pop()
                blocks[-1] = [(mean * count + last * size) / (count + size), count + size]
        fitted.append([mean for mean, count in blocks for _ in range(count)])
    for before, line in zip(fitted, fitted[1:]):
        line[:] = [max(a, b) for a, b in zip(before, line)]
    return fitted


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
    new_cache: Callable[[], Cache] = DynamicCache,
) -> VerifyCostModel:
    """Time target forwards of `rows` × `tokens` new tokens over a `context`-token KV cache (median of `repeats`),
    fitted to never decrease (`monotone_fit`; the medians are kept as `measured`). The token counts of a row count
    take turns within each repeat, so a burst of load on a shared machine lands on one repeat of each rather than on
    all repeats of one. `new_cache` makes the cache the forwards write into: transformers' `DynamicCache` copies it
    whole at each forward, the engine's `growing_cache` writes in place (48 rows, 121 tokens: 157 against 142 ms)."""
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
        cache = new_cache()
        target(input_ids=prompt, **with_cache(cache), use_cache=True)
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
                target(input_ids=new, position_ids=positions, **with_cache(cache), use_cache=True)
                if repeat:
                    times.append(device_clock(target.device) - start)
                cache.crop(-new.shape[1])
            bar.update()
        seconds.append([sorted(times)[len(times) // 2] for times in timings])
    bar.close()
    return VerifyCostModel(
        list(rows), list(tokens), monotone_fit(seconds), context, machine_description(target), measured=seconds
    )


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
    model = read_or_measure(
        path,
        VerifyCostModel.load,
        "verify-cost profile",
        lambda cached: profile_verify_cost(target, rows=sorted(set(rows) | set(cached.rows if cached else ()))),
        usable=lambda model: set(rows) <= set(model.rows),
    )
    _LOADED[path] = model
    return model
