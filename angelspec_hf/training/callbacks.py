"""Real acceptance during training: speculative decoding on held-back prompts with the current drafter."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from ..metrics import SpeculationStats


@torch.no_grad()
def measure_acceptance(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int) -> SpeculationStats:
    """Greedy speculative decoding of each prompt; the pooled acceptance statistics."""
    was_training = drafter.training
    drafter.eval()
    pooled = SpeculationStats()
    for input_ids in prompts:
        target.generate(input_ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
        pooled = pooled + drafter.speculation_stats
    drafter.train(was_training)
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
        metrics = {"accept/tau": stats.tau}
        metrics.update({f"accept/depth_{k + 1}": rate for k, rate in enumerate(stats.acceptance_by_depth())})
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
