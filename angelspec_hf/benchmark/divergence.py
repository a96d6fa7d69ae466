"""Where a speculative output first differs from plain decoding's, and whether the target hesitated there.

Speculative decoding is lossless, yet batch shapes change floating-point sums: where the target's top-2 logits are
within `NEAR_TIE_GAP`, plain decoding in another batch shape may flip too (a near tie). Any other divergence is a
bug. The single-sequence benchmark and the engine benchmark classify their divergences here.
"""

from __future__ import annotations

import torch


NEAR_TIE_GAP = 1e-3


@torch.no_grad()
def top2_gap(target, sequence: torch.Tensor, position: int) -> float:
    """AR top-2 logit gap for the token at `position` of `sequence` (its logits come from position - 1)."""
    logits = target(sequence[:, :position]).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def divergence(target, prompt_ids: list[int], reference_ids: list[int], output_ids: list[int]) -> dict:
    """The first position where `output_ids` differs from `reference_ids` (both continuing `prompt_ids`; the shorter
    one's length where one is a prefix of the other) and the target's top-2 margin at that token of the reference
    (infinite past its end): a near tie when below `NEAR_TIE_GAP`."""
    position = next(
        (i for i, (a, b) in enumerate(zip(output_ids, reference_ids)) if a != b),
        min(len(output_ids), len(reference_ids)),
    )
    at = len(prompt_ids) + position
    sequence = torch.tensor([list(prompt_ids) + list(reference_ids)], device=target.device)
    margin = top2_gap(target, sequence, at) if at < sequence.shape[1] else float("inf")
    return {"position": position, "margin": margin, "near_tie": margin < NEAR_TIE_GAP}
