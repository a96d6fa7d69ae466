"""Training curves: offline τ (the Trainer's evaluation, `estimate_acceptance`) against compute and data.

A run's `trainer_state.json` holds every evaluation (`eval_tau`), the CPU time spent so far (`cpu_hours`, logged by
`CpuClockCallback` across resumed parts) and, with `include_num_input_tokens_seen`, the training tokens read. The
curve of a finished run is in its output folder; a run still going (or stopped between parts) has it in its newest
checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from .trainer import last_complete_checkpoint


@dataclass
class CurvePoint:
    step: int
    cpu_hours: float | None
    tokens: int | None
    tau: float


def training_curve(run_dir: str) -> list[CurvePoint]:
    """Every evaluation of the run in `run_dir` (its newest trainer state), with the compute and tokens spent by
    then; `run_dir` may also be a trainer state file itself."""
    if os.path.isfile(run_dir):
        candidates = [run_dir]
    else:
        candidates = [os.path.join(run_dir, "trainer_state.json")]
        checkpoint = last_complete_checkpoint(run_dir)
        if checkpoint:
            candidates.append(os.path.join(checkpoint, "trainer_state.json"))
    states = []
    for path in candidates:
        if os.path.exists(path):
            with open(path) as handle:
                states.append(json.load(handle))
    if not states:
        raise FileNotFoundError(
            f"No trainer_state.json in {run_dir} or its checkpoints: is it a training run's folder?"
        )
    history = max(states, key=lambda state: state.get("global_step", 0))["log_history"]
    points, cpu_hours, tokens = [], None, None
    for entry in history:  # an evaluation's entry may lack the clock: use the latest one logged before it
        cpu_hours = entry.get("cpu_hours", cpu_hours)
        tokens = entry.get("num_input_tokens_seen", tokens)
        if "eval_tau" in entry:
            points.append(CurvePoint(entry["step"], cpu_hours, tokens, entry["eval_tau"]))
    return points


def plot_training_curves(curves: dict[str, list[CurvePoint]], path: str, target_tau: float | None = None) -> str:
    """Offline τ against CPU-hours (left) and training tokens (right), one line per run; `path` is a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_compute, by_tokens) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for label, points in curves.items():
        timed = [p for p in points if p.cpu_hours is not None]
        counted = [p for p in points if p.tokens is not None]
        by_compute.plot([p.cpu_hours for p in timed], [p.tau for p in timed], marker="o", ms=3, label=label)
        by_tokens.plot([p.tokens / 1e6 for p in counted], [p.tau for p in counted], marker="o", ms=3, label=label)
    for axis, name in ((by_compute, "CPU-hours (one core for one hour)"), (by_tokens, "training tokens (millions)")):
        if target_tau is not None:
            axis.axhline(target_tau, color="grey", linestyle="--", linewidth=1)
        axis.set_xlabel(name)
        axis.grid(alpha=0.3)
    by_compute.set_ylabel("offline τ (held-out responses)")
    by_compute.legend(fontsize=8)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def curve_table(curves: dict[str, list[CurvePoint]]) -> str:
    """The curves as a Markdown table (run, step, CPU-hours, tokens, τ)."""
    lines = ["| run | step | CPU-hours | training tokens | offline τ |", "| --- | ---: | ---: | ---: | ---: |"]
    for label, points in curves.items():
        for p in points:
            hours = "–" if p.cpu_hours is None else f"{p.cpu_hours:.2f}"
            tokens = "–" if p.tokens is None else f"{p.tokens / 1e6:.2f} M"
            lines.append(f"| {label} | {p.step} | {hours} | {tokens} | {p.tau:.3f} |")
    return "\n".join(lines)


@dataclass
class LogTrend:
    """τ ≈ intercept + slope · ln x (x: CPU-hours or training tokens), least squares over the last `fitted` points."""

    intercept: float
    slope: float
    fitted: int

    def reaches(self, tau: float) -> float | None:
        """The x at which the trend reaches `tau`; None where it never does (a flat or falling trend)."""
        if self.slope <= 0:
            return None
        return math.exp((tau - self.intercept) / self.slope)


def fit_log_trend(points: list[CurvePoint], axis: str = "cpu_hours", tail: float = 0.5) -> LogTrend | None:
    """Fit τ against ln(`axis`) over the last `tail` share of the evaluations (at least three): the run's recent
    trend, not its warm-up, whose fast rise would promise too much. Logarithmic, as drafter curves flatten with
    compute; a saturating curve is flatter still, so the extrapolation is the optimistic one. None with fewer than
    three usable points."""
    usable = [p for p in points if getattr(p, axis) is not None and getattr(p, axis) > 0]
    recent = usable[-max(3, math.ceil(tail * len(usable))) :]
    if len(recent) < 3:
        return None
    xs = [math.log(getattr(p, axis)) for p in recent]
    ys = [p.tau for p in recent]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return LogTrend(mean_y - slope * mean_x, slope, len(recent))


def trend_table(curves: dict[str, list[CurvePoint]], target_tau: float) -> str:
    """Per run, its best τ, the fitted gain per doubling of compute, and the CPU-hours and training tokens at which
    the fitted trends reach `target_tau` (Markdown)."""
    lines = [
        f"| run | best τ | at CPU-hours | τ gain per doubling of CPU-hours | CPU-hours to τ {target_tau:g} "
        f"| training tokens to τ {target_tau:g} |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, points in curves.items():
        best = max(points, key=lambda p: p.tau)
        by_hours, by_tokens = fit_log_trend(points, "cpu_hours"), fit_log_trend(points, "tokens")
        gain = "–" if by_hours is None else f"{by_hours.slope * math.log(2):+.3f}"
        lines.append(
            f"| {label} | {best.tau:.3f} | {'–' if best.cpu_hours is None else f'{best.cpu_hours:.2f}'} | {gain} "
            f"| {_reaches(by_hours, target_tau)} | {_reaches(by_tokens, target_tau)} |"
        )
    return "\n".join(lines)


def _reaches(trend: LogTrend | None, tau: float) -> str:
    """Where a trend reaches τ, for a table: – without a trend (too few points logged)."""
    if trend is None:
        return "–"
    value = trend.reaches(tau)
    if value is None:
        return "never (flat trend)"
    return f"{value:.3g}" if value < 1e6 else f"{value:.2e}"
