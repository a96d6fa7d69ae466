"""Configuration of the AngelSpec MTP drafter (AngelSpec §2)."""

from __future__ import annotations

from ..base import AngelSpecDrafterConfig


class AngelSpecMTPConfig(AngelSpecDrafterConfig):
    r"""
    One decoder layer of the target's family, reused for `num_depths` draft steps with shared parameters.

    Args:
        num_depths (`int`, defaults to 3):
            D, the number of tokens drafted per round (and of TTT depths unrolled in training).
        ttt_token_choice (`str`, defaults to `"argmax"`):
            Training-time test: the token fed to depth k >= 1 is the drafter's own prediction at depth k-1,
            chosen by `"argmax"` or `"sample"`. `"ground_truth"` turns TTT off (teacher forcing at every depth,
            the no-TTT ablation).
        depth_loss_weights (`list[float]`, *optional*):
            Weight of each depth's distillation loss; equal weights (1/D each) by default, as in the paper.
    """

    model_type = "angelspec_mtp"

    def __init__(
        self,
        num_depths: int = 3,
        ttt_token_choice: str = "argmax",
        depth_loss_weights: list[float] | None = None,
        **kwargs,
    ):
        if ttt_token_choice not in ("argmax", "sample", "ground_truth"):
            raise ValueError(f"ttt_token_choice must be 'argmax', 'sample' or 'ground_truth', got {ttt_token_choice!r}")
        if depth_loss_weights is not None and len(depth_loss_weights) != num_depths:
            raise ValueError(f"depth_loss_weights has {len(depth_loss_weights)} entries for {num_depths} depths")
        self.num_depths = num_depths
        self.ttt_token_choice = ttt_token_choice
        self.depth_loss_weights = depth_loss_weights or [1.0 / num_depths] * num_depths
        super().__init__(**kwargs)
