"""Configuration of the AngelSpec MTP drafter (AngelSpec §2)."""

from __future__ import annotations

from .base import AngelSpecDrafterConfig, check_bool, check_int, check_number


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
        target_layer_ids (`list[int]`, *optional*):
            Target layers (0-based) whose outputs condition depth 0. One layer (default: the last, whose output is
            the target's final normed state) is eq. 1's h(0) as it is; several (e.g. low, middle, high, as EAGLE-3)
            are concatenated and projected to the hidden size first.
        hidden_regression_weight (`float`, defaults to 0):
            Weight of an EAGLE-1 feature-regression term: smooth-L1 between the draft features the head reads at
            depth k and the target's final state at the position it predicts from.
        input_layout (`str`, defaults to `"projection"`):
            How the layer reads h(k-1) and E(x̃_k). `"projection"` is eq. 1: `u = W_proj[RMSNorm(h); RMSNorm(E(x))]`
            through a plain decoder layer (the layout of native MTP modules too). `"eagle3"` is EAGLE-3's midlayer:
            attention reads `[RMSNorm(E(x)); RMSNorm(h)]` (2H wide) directly and h is the residual, so that the
            drafter exports to the EAGLE-3 checkpoint layout vLLM and SGLang serve (`angelspec export --format
            eagle3`).
    """

    model_type = "angelspec_mtp"
    drafter_kind = "mtp"  # how benchmarks and tables name this family

    def __init__(
        self,
        num_depths: int = 3,
        training_time_test: bool = True,
        ttt_token_choice: str = "argmax",
        depth_loss_weights: list[float] | None = None,
        target_layer_ids: list[int] | None = None,
        hidden_regression_weight: float = 0.0,
        input_layout: str = "projection",
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_int("num_depths", num_depths)
        check_number("hidden_regression_weight", hidden_regression_weight)
        check_bool("training_time_test", training_time_test)
        if ttt_token_choice not in ("argmax", "sample", "ground_truth"):
            raise ValueError(
                f"ttt_token_choice must be 'argmax', 'sample' or 'ground_truth', got {ttt_token_choice!r}"
            )
        if depth_loss_weights is not None and not (
            isinstance(depth_loss_weights, (list, tuple))
            and len(depth_loss_weights) == num_depths
            and all(isinstance(weight, (int, float)) and weight >= 0 for weight in depth_loss_weights)
        ):
            raise ValueError(
                f"depth_loss_weights must be {num_depths} non-negative weights (one per depth), "
                f"got {depth_loss_weights!r}"
            )
        if input_layout not in ("projection", "eagle3"):
            raise ValueError(f"input_layout must be 'projection' or 'eagle3', got {input_layout!r}")
        self.num_depths = num_depths
        self.input_layout = input_layout
        self.training_time_test = training_time_test
        self.ttt_token_choice = ttt_token_choice
        self.depth_loss_weights = list(depth_loss_weights or [1.0 / num_depths] * num_depths)
        self.hidden_regression_weight = hidden_regression_weight
        layers = self.target_num_hidden_layers
        if target_layer_ids is None and layers:
            target_layer_ids = [layers - 1]
        self.target_layer_ids = list(target_layer_ids or [])
        if layers is not None:
            bad = [
                i
                for i in self.target_layer_ids
                if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers)
            ]
            if bad or not self.target_layer_ids or len(set(self.target_layer_ids)) != len(self.target_layer_ids):
                raise ValueError(
                    f"target_layer_ids must be distinct layers of the target's {layers}, got {target_layer_ids!r}"
                )
            if layers - 1 in self.target_layer_ids[:-1]:
                raise ValueError("target_layer_ids: the target's last layer, when tapped, comes last")
