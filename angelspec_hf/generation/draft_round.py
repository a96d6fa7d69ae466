"""A drafting round: each row's drafted token chosen from the draft logits (argmax or a draw), and what the verify
policy reads of it — each step's confidence inputs (AngelSpec §4's prefix product), usable steps, timing."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from transformers.utils import logging

from .dcut import worth_drafting_further


logger = logging.get_logger(__name__)


class _DraftSteps:
    """Timing and D-cut's early exit over the steps drafted so far, for a `DraftRound` or a share of its rows."""

    start: float
    finished_at: list[float]
    max_steps: int | None = None  # the most steps the drafter of these rows takes, when below the round's (a member's)

    def confidence(self, calibrator) -> torch.Tensor:
        """The calibrated confidences c_k of the steps drafted so far, [rows, steps] (`ConfidenceCalibrator`)."""
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
        confidences = list(self.confidence(calibrator))
        most = max_draft if self.max_steps is None else min(max_draft, self.max_steps)
        return worth_drafting_further(
            confidences, verify_seconds, most, time.perf_counter() - self.start, step_seconds
        )


class DraftRound(_DraftSteps):
    """One round of sequential drafting, shared by `generate()`'s candidate generator and the batched engine: picks
    each row's token from the draft logits (argmax, or a draw from q = softmax(logits / T)), and records what the
    verify policy needs — each step's confidence inputs, which steps had usable (finite) scores, and timing. It is
    the `choose` a drafter's `propose` calls; `keep_drafting()` asks the verify policy whether to draft on.

    Confidence of step k (`confidence(calibrator)`): c_k = Π_{j<k} a(q_j(x_j)) · a(m_k), a() the calibrated
    conditional acceptance of a step, where m_k is known before x_k is drawn: max q_k for a greedy row (so c_k is
    §4's prefix product Π_{j≤k} q_j(x_j), each factor calibrated), E_{x~q_k}[q_k(x)] = Σ q_k² for a sampled row.
    Rejection sampling is exact only if whether x_k is verified does not depend on x_k itself, so a sampled row's
    confidence at k must not read x_k (`dcut_depths` also decides such rows position by position).
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
        chosen, known, token, finite = self._pick(logits, index)
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

    def _pick(self, logits: torch.Tensor, index: list[int]) -> tuple[torch.Tensor, ...]:
        """Each row's token, q(token), m (see the class docstring) and whether its scores were finite, on the CPU.
        A greedy row reads two passes over the vocabulary (max and logsumexp: q(argmax) = exp(max − lse) = max q);
        only sampled rows build q in full, to draw from it. A row with a non-finite score (NaN, +inf, or every score
        −inf) has a non-finite max or logsumexp; a sampled one draws from the uniform law then (never verified)."""
        scaled = logits.float()
        temperatures = self.temperatures[index].to(scaled.device)
        if bool((temperatures != 1).any()):
            scaled = scaled / temperatures[:, None]
        best, token = scaled.max(-1)
        normalizer = scaled.logsumexp(-1)
        finite = (torch.isfinite(best) & torch.isfinite(normalizer)).cpu()
        if not bool(finite.all()):
            logger.warning_once(
                "The drafter produced non-finite scores (NaN or inf): those drafts are not verified, and the target's "
                "own tokens are emitted instead (shown once)."
            )
        chosen = (best - normalizer).exp()
        known = chosen.clone()
        sampled = self.sampled[index]
        for position in sampled.nonzero()[:, 0].tolist():
            probabilities = scaled[position].softmax(-1)
            if not bool(finite[position]):
                probabilities = torch.full_like(probabilities, 1.0 / probabilities.numel())
            token[position] = draw(probabilities, self.generators[index[position]])
            chosen[position] = probabilities[token[position]]
            known[position] = probabilities.square().sum()
        return chosen.cpu(), known.cpu(), token, finite

    def rows(self, rows: Sequence[int]) -> "DraftRoundRows":
        """These rows of the round, drafted apart from the others."""
        return DraftRoundRows(self, rows)

    def keep_drafting(self) -> bool:
        return self.keep_drafting_rule is None or self.keep_drafting_rule(self)

    def chosen_probabilities(self) -> torch.Tensor:
        """The draft probabilities q_k(x_k) so far, [rows, steps], on the CPU."""
        return torch.stack(self.probabilities, 1)

    def confidence(self, calibrator) -> torch.Tensor:
        """c_k = Π_{j<k} a(q_j(x_j)) · a(m_k) for the steps so far, [rows, steps] (see the class docstring)."""
        known = torch.stack(self.known_before, 1)
        return calibrator(self.chosen_probabilities(), known, self.row_sources())

    def usable_steps(self) -> list[int]:
        """Per row, how many leading steps had finite draft scores (only those may be verified)."""
        if not self.usable:
            return [0] * len(self.sampled)
        return torch.stack(self.usable, 1).long().cumprod(-1).sum(-1).tolist()


def draw(probabilities: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token drawn from `probabilities` [V] by inverting its CDF at a uniform draw (float64): exactly the law
    `torch.multinomial` draws from, in a twentieth of its time over a 49k vocabulary on a CPU."""
    return draw_rows(probabilities[None], [generator])[0]


CDF_BLOCK = 256  # tokens per block of `draw_rows`' two-level CDF


def draw_rows(probabilities: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """`draw` for each row of `probabilities` [n, V] with its own generator (one float64 uniform each), for all rows
    at once (`inverse_cdf`)."""
    uniforms = torch.stack(
        [
            torch.rand((), generator=generator, dtype=torch.float64, device=probabilities.device)
            for generator in generators
        ]
    )
    return inverse_cdf(probabilities, uniforms).tolist()


def inverse_cdf(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.LongTensor:
    """Per row of `probabilities` [n, V], the token where its CDF passes `uniforms` [n] (in [0, 1)) times the row's
    mass, in two levels: the block of `CDF_BLOCK` tokens where the cumulative block mass passes it (block masses
    summed in float32), then the token where the block's float64 CDF passes the same share of the block. For a step
    of sampled regeneration (48 rows, a 49k vocabulary, a 2-core CPU) a float64 CDF over the whole vocabulary took
    1.4-11.6 ms, this 0.4-0.5 ms (`benchmarks/issue36/regen_share/draw_cost.py`, five runs). A token of zero
    probability is never drawn, also where rounding puts the point past a block's or the row's last mass."""
    rows, vocab = probabilities.shape
    if vocab % CDF_BLOCK:
        probabilities = torch.nn.functional.pad(probabilities, (0, CDF_BLOCK - vocab % CDF_BLOCK))
    blocks = probabilities.reshape(rows, -1, CDF_BLOCK)
    block_cdf = blocks.sum(-1).double().cumsum(-1)
    point = uniforms.double() * block_cdf[:, -1]
    block = _invert(block_cdf, point)
    edges = torch.nn.functional.pad(block_cdf, (1, 0)).gather(1, torch.stack([block, block + 1], 1))
    before, mass = edges[:, 0], edges[:, 1] - edges[:, 0]  # the mass before the chosen block, and its own
    within = blocks[torch.arange(rows, device=blocks.device), block].double().cumsum(-1)
    share = ((point - before) / mass).nan_to_num(0.0)
    return block * CDF_BLOCK + _invert(within, share * within[:, -1])


def _invert(cdf: torch.Tensor, point: torch.Tensor) -> torch.LongTensor:
    """Per row of a CDF [n, m], the first index whose cumulative mass exceeds `point` [n], at most the row's last
    index of positive mass (where the mass reaches its total)."""
    found = torch.searchsorted(cdf, point[:, None], right=True)[:, 0]
    last_positive = (cdf < cdf[:, -1:]).sum(-1)
    return torch.minimum(found, last_positive)


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

    def confidence(self, calibrator) -> torch.Tensor:
        return self.round.confidence(calibrator)[self.row_index, : len(self.finished_at)]

    def row_sources(self) -> torch.LongTensor:
        return self.round.sources[self.row_index, None]

    def keep_drafting(self) -> bool:
        return self.round.keep_drafting_rule is None or self.round.keep_drafting_rule(self)
