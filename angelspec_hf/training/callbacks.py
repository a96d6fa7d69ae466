"""Real acceptance during training: speculative decoding on held-back prompts with the current drafter."""

from __future__ import annotations

import signal
import time

import torch
from transformers import TrainerCallback

from ..acceptance_metric import SpeculativeAcceptance
from ..generation.policies import Constant
from ..metrics import SpeculationStats


@torch.no_grad()
def measure_acceptance(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int) -> SpeculationStats:
    """Greedy speculative decoding of each prompt under the `constant` policy, every round verifying all the drafter
    drafts (so acceptance is measured at every depth, whatever policy the drafter is set to); the pooled acceptance
    statistics. The drafter's own policy settings are restored afterwards."""
    config = drafter.generation_config
    measuring = Constant(int(config.num_assistant_tokens)).generation_settings()
    saved = {key: getattr(config, key) for key in measuring}
    was_training = drafter.training
    drafter.eval()
    config.update(**measuring)
    pooled = SpeculationStats()
    try:
        for input_ids in prompts:
            target.generate(input_ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
            pooled = pooled + drafter.speculation_stats
    finally:
        drafter.train(was_training)
        config.update(**saved)
    return pooled


class AcceptanceCallback(TrainerCallback):
    """Every `every_n_steps` steps (and at the end) measure τ and per-depth acceptance, logged as `accept/*`."""

    def __init__(self, target, prompts: list[torch.Tensor], max_new_tokens: int = 64, every_n_steps: int = 100):
        self.target = target
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.every_n_steps = every_n_steps
        self._pending: dict[str, float] = {}
        self.history: list[dict] = []

    def _measure(self, state, model):
        if not state.is_world_process_zero or not self.prompts:
            return
        stats = measure_acceptance(self.target, model, self.prompts, self.max_new_tokens)
        result = SpeculativeAcceptance().compute(drafted=stats.drafted, accepted=stats.accepted)
        metrics = {"accept/tau": result["tau"]}
        metrics.update({f"accept/depth_{k + 1}": rate for k, rate in enumerate(result["acceptance_by_depth"])})
        self._pending.update(metrics)
        self.history.append({"step": state.global_step, **metrics})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._measure(state, model)
            control.should_log = True

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._measure(state, model)

    def pop_metrics(self) -> dict[str, float]:
        metrics, self._pending = self._pending, {}
        return metrics


class CpuClockCallback(TrainerCallback):
    """Training compute as CPU time: every thread of the training process, summed over the resumed parts of a run.

    Each log entry gets `cpu_hours`, the x-axis of a training curve (one core for one hour is one CPU-hour); with
    `max_cpu_minutes`, training stops (with a final evaluation and save) once the run has used that much. CPU time,
    not wall time, so a run sharing the cores gets the same compute; the clock starts in `train()`, so preparing
    data and hidden-state caches does not count, and a resumed run starts from the `cpu_hours` its checkpoint logged.
    `max_wall_minutes` is a wall-clock budget for this part of the run (on a lent GPU, wall time is what is lent).
    """

    def __init__(self, max_cpu_minutes: float | None = None, max_wall_minutes: float | None = None):
        self.max_cpu_minutes = max_cpu_minutes
        self.max_wall_minutes = max_wall_minutes
        self.start = self.wall_start = 0.0
        self.hours_before: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start, self.wall_start, self.hours_before = time.process_time(), time.monotonic(), None

    def hours(self, state) -> float:
        if self.hours_before is None:  # read once the resumed state is loaded (after `on_train_begin`)
            logged = [entry["cpu_hours"] for entry in state.log_history if "cpu_hours" in entry]
            self.hours_before = logged[-1] if logged else 0.0
        return self.hours_before + (time.process_time() - self.start) / 3600

    def on_log(self, args, state, control, logs=None, **kwargs):
        state.log_history[-1]["cpu_hours"] = round(self.hours(state), 6)  # the entry `Trainer.log` just appended

    def on_step_end(self, args, state, control, **kwargs):
        out_of_cpu = self.max_cpu_minutes is not None and 60 * self.hours(state) >= self.max_cpu_minutes
        out_of_wall = (
            self.max_wall_minutes is not None and time.monotonic() - self.wall_start >= 60 * self.max_wall_minutes
        )
        if out_of_cpu or out_of_wall:
            control.should_training_stop = True
            control.should_log = True
            control.should_evaluate = args.eval_strategy != "no"
            control.should_save = args.save_strategy != "no"


class GracefulStopCallback(TrainerCallback):
    """Stop at the end of the current step, with a checkpoint, when the process gets SIGTERM (or SIGINT): a long
    run stopped this way (`kill -TERM <pid>`) resumes where it stopped, losing nothing. The previous handlers come
    back when training ends."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.previous: dict = {}

    def _request(self, signum, frame):
        self.requested = True

    def on_train_begin(self, args, state, control, **kwargs):
        self.previous = {sig: signal.signal(sig, self._request) for sig in self.SIGNALS}

    def on_step_end(self, args, state, control, **kwargs):
        if self.requested:
            control.should_training_stop = True
            control.should_log = True
            control.should_save = args.save_strategy != "no"

    def on_train_end(self, args, state, control, **kwargs):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
