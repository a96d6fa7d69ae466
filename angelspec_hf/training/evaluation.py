"""Offline acceptance estimate: what greedy speculative decoding would accept, computed from target hidden states of
held-out target-generated responses, without running the target.

Each response is the target's own greedy continuation of its prompt, so a draft token is accepted exactly when it
equals the next response token. The drafter's training forward in eval mode returns its greedy draft chain from
every position (MTP: all D depths unrolled on its own argmax tokens; DFly: a block at every anchor, its AR head
reading the predecessor, which equals the drafter's own choice while the chain is accepted). The chains are then
walked as `generate()` walks rounds: the prefill is a round of its own (one forward, one token), then each round accepts the
longest matching prefix of at most `min(d, tokens left - 1)` drafts and adds the bonus token. So τ here is the τ
that `generate(..., assistant_model=drafter)` with a constant schedule measures on the same prompts.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from ..metrics import SpeculationStats
from .data import batch_hidden_states
from .losses import position_weighted_loss


RECALL_AT = (1, 2, 4, 8)


class AcceptanceEstimate:
    """Greedy draft chains of held-out responses, added batch by batch; `metrics()` walks them as rounds."""

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens
        self.chains: list[torch.Tensor] = []  # per response: accepted chain length from each of its positions
        self.recall_hits = torch.zeros(num_draft_tokens, len(RECALL_AT))
        self.recall_tried = torch.zeros(num_draft_tokens)
        self.losses: list[float] = []

    @torch.no_grad()
    def add(self, drafter, predictions, input_ids, document_ids, loss_mask) -> None:
        """Record the chains of one batch from `predictions` (the drafter's eval-mode `DraftPredictions`)."""
        depth = predictions.draft_positions
        kept = depth <= self.num_draft_tokens
        logits, teacher_positions, depth = predictions.logits[kept], predictions.teacher_positions[kept], depth[kept]
        truth = input_ids.flatten()[teacher_positions + 1]  # the target's greedy token after each teacher position
        ranked = drafter.to_target_ids(logits.topk(min(max(RECALL_AT), logits.shape[-1]), dim=-1).indices)
        found = ranked == truth[:, None]
        hits = torch.stack([found[:, :n].any(-1) for n in RECALL_AT], dim=-1)  # [N, len(RECALL_AT)]

        # correct[e, k-1]: draft k of the round whose verified sequence ends at flat position e is the target's token.
        starts = teacher_positions - depth + 1
        correct = torch.zeros(input_ids.numel(), self.num_draft_tokens, dtype=torch.bool, device=input_ids.device)
        correct[starts, depth - 1] = hits[:, 0]
        chain = correct.long().cumprod(-1).sum(-1)  # accepted drafts of a greedy chain from each position

        tried = chain[starts] >= depth - 1  # depth k is verified only when drafts 1..k-1 were accepted
        self.recall_tried += torch.bincount(depth[tried] - 1, minlength=self.num_draft_tokens).cpu().float()
        for column in range(len(RECALL_AT)):
            scored = tried & hits[:, column]
            self.recall_hits[:, column] += (
                torch.bincount(depth[scored] - 1, minlength=self.num_draft_tokens).cpu().float()
            )

        chain = chain.view_as(input_ids).cpu()
        for row in range(input_ids.shape[0]):
            response = loss_mask[row].bool().cpu()
            documents = document_ids[row].cpu()
            for document in documents[response].unique().tolist():
                positions = (response & (documents == document)).nonzero()[:, 0]
                self.chains.append(chain[row, positions[0] : positions[-1] + 1])

    def rounds(self, num_draft_tokens: int) -> SpeculationStats:
        """The rounds of greedy speculative decoding drafting `num_draft_tokens` per round over every response."""
        stats = SpeculationStats()
        for chain in self.chains:
            stats.record_round(0, 0)  # the prefill: one target forward, the first response token
            last, verified = len(chain) - 1, 0
            while verified < last:
                drafted = min(num_draft_tokens, last - verified - 1)
                accepted = min(int(chain[verified]), drafted)
                stats.record_round(drafted, accepted)
                verified += accepted + 1
        return stats

    def metrics(self) -> dict:
        """τ at every draft length 1..D, acceptance by depth and top-n recall by depth (given the chain reached
        it), the mean distillation loss, and how many responses and rounds were read."""
        full = self.rounds(self.num_draft_tokens)
        metrics = {"tau": full.tau}
        metrics.update({f"tau_depth_{d}": self.rounds(d).tau for d in range(1, self.num_draft_tokens + 1)})
        metrics.update({f"acceptance_depth_{k + 1}": rate for k, rate in enumerate(full.acceptance_by_depth())})
        recall = self.recall_hits / self.recall_tried.clamp(min=1)[:, None]
        for column, n in enumerate(RECALL_AT):
            metrics.update(
                {f"recall_top{n}_depth_{k + 1}": recall[k, column].item() for k in range(self.num_draft_tokens)}
            )
        if self.losses:
            metrics["loss"] = sum(self.losses) / len(self.losses)
        metrics.update(rounds=full.target_forwards, documents=len(self.chains))
        return metrics


@torch.no_grad()
def estimate_acceptance(drafter, batches: Iterable[dict], target=None, num_draft_tokens: int | None = None) -> dict:
    """`AcceptanceEstimate.metrics()` over collated batches of held-out responses (`PackedCollator` rows; offline
    `target_hidden` or, without it, states computed by `target`). Drafts `num_draft_tokens` per round (default:
    the drafter's `generation_config.num_assistant_tokens`). The drafter's train/eval mode is restored after."""
    num_draft_tokens = num_draft_tokens or drafter.generation_config.num_assistant_tokens
    estimate = AcceptanceEstimate(num_draft_tokens)
    was_training = drafter.training
    drafter.eval()
    try:
        for inputs in batches:
            hidden = batch_hidden_states(drafter, target, inputs)
            predictions = drafter(
                target_hidden=hidden,
                input_ids=inputs["input_ids"],
                position_ids=inputs["position_ids"],
                document_ids=inputs["document_ids"],
                loss_mask=inputs["loss_mask"],
                num_draft_tokens=num_draft_tokens,
            )
            teacher = drafter.target_head_logits(hidden[:, -1].flatten(0, 1)[predictions.teacher_positions])
            loss = position_weighted_loss(drafter, predictions.logits, teacher, predictions.draft_positions)
            estimate.losses.append(loss.item())
            estimate.add(drafter, predictions, inputs["input_ids"], inputs["document_ids"], inputs["loss_mask"])
    finally:
        drafter.train(was_training)
    return estimate.metrics()


def estimate_on_responses(
    drafter,
    target,
    responses: str,
    sources: list[str] | None = None,
    max_length: int = 1024,
    hidden_cache_dir: str = os.path.join(".cache", "hidden_states"),
    num_draft_tokens: int | None = None,
) -> dict:
    """`estimate_acceptance` on a held-out responses file (only its `sources`, when given): packed, the drafter's
    tapped target states cached under `hidden_cache_dir`, walked as rounds. What `angelspec estimate` prints."""
    from torch.utils.data import DataLoader

    from .data import PackedCollator, build_training_dataset, precompute_hidden_states

    dataset = build_training_dataset(responses, max_length, sources=sources)
    dataset = precompute_hidden_states(dataset, target, drafter.training_hidden_state_indices(), hidden_cache_dir)
    batches = DataLoader(dataset, batch_size=4, collate_fn=PackedCollator())
    return estimate_acceptance(drafter, batches, num_draft_tokens=num_draft_tokens)
