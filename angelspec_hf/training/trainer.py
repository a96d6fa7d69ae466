"""`AngelSpecTrainer`: a `transformers.Trainer` whose loss is the drafter's distillation to the frozen target.

The drafter's `forward` unrolls its drafting exactly as inference will (for MTP: the TTT rollout of §2.2); the
trainer supplies the target's hidden states (online from the target in this process, or offline from the
precomputed cache) and distils depth k to the target's distribution k positions ahead.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import Trainer

from .data import target_hidden_states


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, top_k: int | None = None) -> torch.Tensor:
    """KL(p_target || q_draft) per position, over the draft vocabulary or only the teacher's top-k (renormalised)."""
    student_logp = student_logits.float().log_softmax(-1)
    teacher_logits = teacher_logits.float()
    if top_k is not None and top_k < teacher_logits.shape[-1]:
        teacher_logits, indices = teacher_logits.topk(top_k, dim=-1)
        student_logp = student_logp.gather(-1, indices)
    teacher_logp = teacher_logits.log_softmax(-1)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)


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
                self.target, inputs["input_ids"], inputs["position_ids"], drafter.target_hidden_state_indices()
            )
            hidden = torch.stack(states, dim=1)
        hidden = hidden.to(drafter.dtype).detach()
        outputs = model(
            target_hidden=hidden,
            input_ids=inputs["input_ids"],
            position_ids=inputs["position_ids"],
            document_ids=inputs["document_ids"],
        )
        with torch.no_grad():
            teacher = drafter.target_head_logits(hidden[:, -1])
        loss = self.depth_distillation_loss(outputs.logits, teacher, inputs["loss_mask"], inputs["document_ids"])
        return (loss, outputs) if return_outputs else loss

    def depth_distillation_loss(self, depth_logits, teacher, loss_mask, document_ids) -> torch.Tensor:
        """Σ_k w_k · mean KL(target at position t+k+1 || depth k at slot t) over valid slots.

        Slot t of depth k predicts token t+k+2: valid when that token is a response token of the same document.
        """
        config = self.drafter.config
        length = teacher.shape[1]
        loss = depth_logits[0].sum() * 0.0  # stays in the graph (and DDP's) when a batch has no valid slot
        for depth, (logits, weight) in enumerate(zip(depth_logits, config.depth_loss_weights)):
            span = length - depth - 2
            if span <= 0:
                continue
            valid = loss_mask[:, depth + 2 :].bool() & (document_ids[:, :span] == document_ids[:, depth + 2 :])
            if not valid.any():
                continue
            student, target = logits[:, :span][valid], teacher[:, depth + 1 : depth + 1 + span][valid]
            loss = loss + weight * distillation_kl(student, target, config.kl_top_k).mean()
            with torch.no_grad():
                agreement = (student.argmax(-1) == target.argmax(-1)).float().mean().item()
            self._metrics[f"top1_agreement_depth_{depth + 1}"].append(agreement)
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
