"""Real acceptance during training: speculative decoding on held-back prompts with the current drafter."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

from ..metrics import SpeculationStats, SpeculativeAcceptance


@torch.no_grad()
def measure_acceptance(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int) -> SpeculationStats:
    """Greedy speculative decoding of each prompt, every round verifying all the drafter drafts (so acceptance is
    measured at every depth, whatever schedule the drafter is set to); the pooled acceptance statistics."""
    was_training, schedule = drafter.training, drafter.generation_config.num_assistant_tokens_schedule
    drafter.eval()
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    pooled = SpeculationStats()
    try:
        for input_ids in prompts:
            target.generate(input_ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
            pooled = pooled + drafter.speculation_stats
    finally:
        drafter.train(was_training)
        drafter.generation_config.num_assistant_tokens_schedule = schedule
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


class TimeBudgetCallback(TrainerCallback):
    """Stop training (with a final evaluation and save) once `minutes` of wall time have passed in this process:
    recipes compared at one fixed compute budget rather than one step count."""

    def __init__(self, minutes: float):
        self.seconds = 60.0 * minutes
        self.start: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() - self.start >= self.seconds:
            control.should_training_stop = True
            control.should_evaluate = args.eval_strategy != "no"
            control.should_save = args.save_strategy != "no"
