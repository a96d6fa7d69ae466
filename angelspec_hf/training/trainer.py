"""`AngelSpecTrainer`: a `transformers.Trainer` whose loss is the drafter's distillation to the frozen target.

One trainer for every drafter. The drafter's `forward` unrolls its drafting exactly as inference will (MTP: the
TTT rollout of §2.2) and returns its supervised predictions with the target positions they are distilled to; the
trainer supplies the target's hidden states (online from the target in this process, or offline from the
precomputed cache), applies the target's lm_head there as the teacher, and weights each draft position.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import Trainer

from .data import target_hidden_states


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, top_k: int | None = None) -> torch.Tensor:
    """KL(p_target || q_draft) per prediction, over the draft vocabulary or only the teacher's top-k (renormalised)."""
    student_logp = student_logits.float().log_softmax(-1)
    teacher_logits = teacher_logits.float()
    if top_k is not None and top_k < teacher_logits.shape[-1]:
        teacher_logits, indices = teacher_logits.topk(top_k, dim=-1)
        student_logp = student_logp.gather(-1, indices)
    teacher_logp = teacher_logits.log_softmax(-1)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)


def draft_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, loss_type: str = "kl", top_k: int | None = None,
    lk_eta: float = 3.0,
) -> torch.Tensor:
    """Per-prediction loss of a draft distribution q against the target distribution p.

    `kl`: KL(p || q). `ce`: -log q(argmax p). `tv`: 1 - α, α = Σ min(p, q) (the expected acceptance of one draft
    token). `lk`: λ·KL + (1-λ)·TV with λ = exp(-η·sg[α]) (AngelSpec): KL while the draft is far off, TV near the
    optimum, where it matches acceptance directly.
    """
    if loss_type == "kl":
        return distillation_kl(student_logits, teacher_logits, top_k)
    if loss_type == "ce":
        return F.cross_entropy(student_logits.float(), teacher_logits.argmax(-1), reduction="none")
    overlap = torch.minimum(student_logits.float().softmax(-1), teacher_logits.float().softmax(-1)).sum(-1)
    if loss_type == "tv":
        return 1.0 - overlap
    if loss_type == "lk":
        weight = torch.exp(-lk_eta * overlap.detach())
        return weight * distillation_kl(student_logits, teacher_logits, top_k) + (1.0 - weight) * (1.0 - overlap)
    raise ValueError(f"Unknown loss_type {loss_type!r}")


class AngelSpecTrainer(Trainer):
    """Trainer for AngelSpec drafters.

    Args:
        target: the frozen target model. Needed for online hidden states; in offline mode (rows carry
            `target_hidden`) it is still needed for its embedding and lm_head, which the drafter borrows.
    """

    def __init__(self, *args, target=None, **kwargs):
        args_ = kwargs.get("args") or (args[1] if len(args) > 1 else None)
        if args_ is not None:
            args_.remove_unused_columns = False  # loss_mask and target_hidden are not forward() arguments
        super().__init__(*args, **kwargs)
        if target is None:
            raise ValueError("AngelSpecTrainer needs the target model (target=...)")
        self.target = target.eval().requires_grad_(False)
        self.drafter.bind_target(self.target)
        self._metrics: dict[str, list[float]] = defaultdict(list)

    @property
    def drafter(self):
        return self.accelerator.unwrap_model(self.model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        drafter = self.drafter
        hidden = inputs.get("target_hidden")
        if hidden is None:
            states = target_hidden_states(
                self.target, inputs["input_ids"], inputs["position_ids"], drafter.training_hidden_state_indices()
            )
            hidden = torch.stack(states, dim=1)
        hidden = hidden.to(drafter.dtype).detach()
        outputs = model(
            target_hidden=hidden,
            input_ids=inputs["input_ids"],
            position_ids=inputs["position_ids"],
            document_ids=inputs["document_ids"],
            loss_mask=inputs["loss_mask"],
        )
        with torch.no_grad():  # the teacher: the target's lm_head on its final state, only where it is needed
            teacher = drafter.target_head_logits(hidden[:, -1].flatten(0, 1)[outputs.teacher_positions])
        loss = self.weighted_draft_loss(outputs.logits, teacher, outputs.draft_positions)
        return (loss, outputs) if return_outputs else loss

    def weighted_draft_loss(self, logits, teacher, draft_positions) -> torch.Tensor:
        """Σ_k w_k · mean loss of the predictions at draft position k (MTP depth k, DFly block offset k)."""
        config = self.drafter.config
        per_prediction = draft_loss(logits, teacher, config.loss_type, config.kl_top_k, config.lk_eta)
        weights = self.drafter.draft_position_weights()
        loss = logits.sum() * 0.0  # stays in the graph (and DDP's) when a batch has no supervised prediction
        for position in draft_positions.unique().tolist():
            selected = draft_positions == position
            loss = loss + weights[position - 1] * per_prediction[selected].mean()
            with torch.no_grad():
                agreement = (logits[selected].argmax(-1) == teacher[selected].argmax(-1)).float().mean().item()
            self._metrics[f"top1_agreement_position_{position}"].append(agreement)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the averaged per-depth agreement and the latest acceptance measurements to every training log."""
        if "loss" in logs:
            logs.update({key: sum(values) / len(values) for key, values in self._metrics.items() if values})
            self._metrics.clear()
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "pop_metrics"):
                logs.update(callback.pop_metrics())
        super().log(logs, start_time)
