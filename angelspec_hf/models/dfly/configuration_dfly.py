"""Configuration of the AngelSpec DFly block-diffusion drafter (and its DFlash ablation)."""

from __future__ import annotations

from ..base import AngelSpecDrafterConfig, check_bool, check_int, check_number


def evenly_spaced_layers(num_target_layers: int, count: int) -> list[int]:
    """`count` target layer indices evenly spaced from 1 to L-3 (DFlash / AngelSpec default taps); a target of one
    layer has only layer 0 to tap."""
    last = min(num_target_layers - 1, max(1, num_target_layers - 3))
    first = min(1, last)
    if count == 1:
        return [last]
    return sorted({round(first + i * (last - first) / (count - 1)) for i in range(count)})


class DFlyConfig(AngelSpecDrafterConfig):
    r"""
    A block-diffusion drafter: the last accepted token plus `block_size - 1` mask tokens drafted in one forward,
    bidirectional inside the block, with the target's hidden states of `target_layer_ids` injected as extra keys and
    values in every draft layer.

    Args:
        block_size (`int`, defaults to 16): tokens per block (the anchor and `block_size - 1` drafts).
        num_draft_layers (`int`, defaults to 3): decoder layers of the target's family in the drafter.
        target_layer_ids (`list[int]`, *optional*): tapped target layers (0-based); default: `num_target_layers_tapped`
            layers evenly spaced from 1 to L-3.
        num_target_layers_tapped (`int`, defaults to 5): how many layers to tap when `target_layer_ids` is not given.
        mask_token_id (`int`): the token id filling the block's masked positions; must be in the target vocabulary.
        per_layer_context_mix (`bool`, defaults to `True`): DFly hybrid conditioning, per draft layer i
            `ctx_i = RMSNorm(FC(concat H) + Σ_t softmax(w_i)_t H_t)`; `False` uses DFlash's shared `RMSNorm(FC(concat H))`.
        ar_head (`bool`, defaults to `True`): DFly's predecessor-conditioned head
            `h'_k = h_k + SwiGLU([RMSNorm(h_k); RMSNorm(E(x_{k-1}))])` (output projection zero-initialised).
        position_decay_gamma (`float`, defaults to 7.0): loss weight of block position k is `exp(-(k-1)/γ)`.
        anchors_per_row (`int`, defaults to 32): random anchor blocks per packed training row.

    With `per_layer_context_mix=False` and `ar_head=False` the model is DFlash.
    """

    model_type = "angelspec_dfly"

    @property
    def drafter_kind(self) -> str:
        """How benchmarks and tables name it: `dfly`, or `dflash` with both DFly additions off (the ablation)."""
        return "dfly" if (self.per_layer_context_mix or self.ar_head) else "dflash"

    def __init__(
        self,
        block_size: int = 16,
        num_draft_layers: int = 3,
        target_layer_ids: list[int] | None = None,
        num_target_layers_tapped: int = 5,
        mask_token_id: int | None = None,
        per_layer_context_mix: bool = True,
        ar_head: bool = True,
        position_decay_gamma: float = 7.0,
        anchors_per_row: int = 32,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_int("block_size", block_size, minimum=2)  # the anchor and at least one draft
        check_int("num_draft_layers", num_draft_layers)
        check_int("num_target_layers_tapped", num_target_layers_tapped)
        check_bool("per_layer_context_mix", per_layer_context_mix)
        check_bool("ar_head", ar_head)
        check_number("position_decay_gamma", position_decay_gamma, positive=True)
        check_int("anchors_per_row", anchors_per_row)
        self.block_size = block_size
        self.num_draft_layers = num_draft_layers
        self.num_hidden_layers = num_draft_layers  # what a cache built from this config sizes itself by
        if target_layer_ids is None and self.target_num_hidden_layers:
            target_layer_ids = evenly_spaced_layers(self.target_num_hidden_layers, num_target_layers_tapped)
        self.target_layer_ids = list(target_layer_ids or [])
        self.num_target_layers_tapped = len(self.target_layer_ids) or num_target_layers_tapped
        self.mask_token_id = mask_token_id
        self.per_layer_context_mix = per_layer_context_mix
        self.ar_head = ar_head
        self.position_decay_gamma = position_decay_gamma
        self.anchors_per_row = anchors_per_row
        if self.target_num_hidden_layers is not None:
            if not self.target_layer_ids:
                raise ValueError("target_layer_ids is empty: DFly needs at least one tapped target layer")
            missing = [
                i for i in self.target_layer_ids if not (isinstance(i, int) and 0 <= i < self.target_num_hidden_layers)
            ]
            if missing:
                raise ValueError(
                    f"target_layer_ids {missing} do not exist in a target with {self.target_num_hidden_layers} layers"
                )
        if mask_token_id is not None:
            check_int("mask_token_id", mask_token_id, minimum=0)
            if self.vocab_size is not None and mask_token_id >= self.vocab_size:
                raise ValueError(
                    f"mask_token_id {mask_token_id} is outside the target vocabulary of {self.vocab_size}"
                )
        max_positions = self.target_config.get("max_position_embeddings")
        if max_positions is not None and block_size > max_positions:
            raise ValueError(f"block_size {block_size} exceeds the target context of {max_positions} positions")
