"""Distillation losses of a draft distribution q against the frozen target's p, per prediction and weighted by
draft position (MTP depth, DFly block offset)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def distillation_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, top_k: int | None = None
) -> torch.Tensor:
    """KL(p_target || q_draft) per prediction, over the draft vocabulary or only the teacher's top-k (renormalised)."""
    student_logp = student_logits.float().log_softmax(-1)
    teacher_logits = teacher_logits.float()
    if top_k is not None and top_k < teacher_logits.shape[-1]:
        teacher_logits, indices = teacher_logits.topk(top_k, dim=-1)
        student_logp = student_logp.gather(-1, indices)
    teacher_logp = teacher_logits.log_softmax(-1)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)


def draft_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_type: str = "kl",
    top_k: int | None = None,
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


def position_weighted_loss(
    drafter, logits: torch.Tensor, teacher: torch.Tensor, draft_positions: torch.LongTensor
) -> torch.Tensor:
    """Σ_k w_k · mean loss of the predictions at draft position k, w = `drafter.draft_position_weights()`."""
    config = drafter.config
    per_prediction = draft_loss(logits, teacher, config.loss_type, config.kl_top_k, config.lk_eta)
    weights = drafter.draft_position_weights()
    loss = logits.sum() * 0.0  # stays in the graph (and DDP's) when a batch has no supervised prediction
    for position in draft_positions.unique().tolist():
        loss = loss + weights[position - 1] * per_prediction[draft_positions == position].mean()
    return loss


def feature_regression_loss(draft_features: torch.Tensor, target_features: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's feature regression: smooth-L1 between draft features and the target's, per element, averaged."""
    return F.smooth_l1_loss(draft_features.float(), target_features.float())


def with_feature_noise(hidden: torch.Tensor, std: float) -> torch.Tensor:
    """A copy of the target states `hidden` [B, N, T, H] with Gaussian noise of `std` times each state's RMS (EAGLE's
    feature noise): what the drafter reads in training; the teacher is read from the clean states."""
    if not std:
        return hidden
    scale = hidden.float().pow(2).mean(-1, keepdim=True).sqrt().to(hidden.dtype)
    return hidden + torch.randn_like(hidden) * std * scale
