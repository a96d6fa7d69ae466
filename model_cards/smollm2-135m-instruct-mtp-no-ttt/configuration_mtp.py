"""Configuration of the AngelSpec MTP drafter (AngelSpec §2)."""

from __future__ import annotations

from .base import AngelSpecDrafterConfig, check_bool, check_int


class AngelSpecMTPConfig(AngelSpecDrafterConfig):
    r"""
    One decoder layer of the target's family, reused for `num_depths` draft steps with shared parameters.

    Args:
        num_depths (`int`, defaults to 3):
            D, the number of tokens drafted per round (and of TTT depths unrolled in training).
        training_time_test (`bool`, defaults to `True`):
            Unroll the D depths in training as inference runs them (TTT). `False` is the no-TTT ablation: only
            depth 0 is trained (target hidden state, ground-truth token), and inference reuses it on its own states.
        ttt_token_choice (`str`, defaults to `"argmax"`):
            The token fed to depth k >= 1 in the rollout: the drafter's own prediction at depth k-1 (`"argmax"` or
            `"sample"`), or `"ground_truth"` (own hidden states, teacher-forced tokens, as EAGLE-3 unrolls).
        depth_loss_weights (`list[float]`, *optional*):
            Weight of each depth's distillation loss; equal weights (1/D each) by default, as in the paper.
    """

    model_type = "angelspec_mtp"

    def __init__(
        self,
        num_depths: int = 3,
        training_time_test: bool = True,
        ttt_token_choice: str = "argmax",
        depth_loss_weights: list[float] | None = None,
        **kwargs,
    ):
        check_int("num_depths", num_depths)
        check_bool("training_time_test", training_time_test)
        if ttt_token_choice not in ("argmax", "sample", "ground_truth"):
            raise ValueError(f"ttt_token_choice must be 'argmax', 'sample' or 'ground_truth', got {ttt_token_choice!r}")
        if depth_loss_weights is not None and not (
            isinstance(depth_loss_weights, (list, tuple))
            and len(depth_loss_weights) == num_depths
            and all(isinstance(weight, (int, float)) and weight >= 0 for weight in depth_loss_weights)
        ):
            raise ValueError(
                f"depth_loss_weights must be {num_depths} non-negative weights (one per depth), "
                f"got {depth_loss_weights!r}"
            )
        self.num_depths = num_depths
        self.training_time_test = training_time_test
        self.ttt_token_choice = ttt_token_choice
        self.depth_loss_weights = list(depth_loss_weights or [1.0 / num_depths] * num_depths)
        super().__init__(**kwargs)
