"""Export a trained drafter to the checkpoint layout serving engines load.

**DFlash** (`DFlashDraftModel`, as z-lab's checkpoints, SpecForge, SGLang `--speculative-algorithm DFLASH` and vLLM
`{"method": "dflash"}` read it): the DFlash configuration of a DFly drafter (`per_layer_context_mix=False`,
`ar_head=False`) computes exactly what that layout does — the context `hidden_norm(fc(concat taps))` of the taps
`hidden_states[i + 1]` for `target_layer_ids` i, fed through every layer's own `k_proj` / `v_proj` / `k_norm` and
RoPE as extra keys and values, the block `[last token, mask…]` through the layers non-causally, `norm`, then the
head — so the export renames tensors and writes the config, nothing else. A reduced draft vocabulary goes out as
`lm_head.weight` with vLLM's `d2t` map (target id = draft id + `d2t[draft id]`); a full one uses the target's head.
The engines build DFlash layers as Qwen3 layers (q/k norms), so only a drafter of a Qwen3-family target exports.

EAGLE-3 is not offered: its midlayer attends over `[input_layernorm(E(x)); hidden_norm(fc(h))]` (2H wide) with
`fc(h)` as the residual, while the AngelSpec MTP layer attends over `RMSNorm(W_proj[RMSNorm(h); RMSNorm(E(x))])`
with `u` as the residual; no renaming of one into the other computes the same drafts.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def dflash_tensors(drafter) -> dict[str, torch.Tensor]:
    """The DFlash layout's tensors, from a DFly drafter in its DFlash configuration (see the module docstring)."""
    from .models.dfly import DFlyConfig

    config = drafter.config
    if not isinstance(config, DFlyConfig) or config.per_layer_context_mix or config.ar_head:
        raise ValueError(
            "Only a DFly drafter in its DFlash configuration (per_layer_context_mix=False, ar_head=False) has the "
            "DFlash layout; the hybrid conditioning and the AR head have no place in it"
        )
    if not hasattr(drafter.layers[0].self_attn, "k_norm"):
        raise ValueError(
            f"SGLang and vLLM build DFlash draft layers as Qwen3 layers (with q/k norms); this drafter's layers are "
            f"{type(drafter.layers[0]).__name__} ({config.target_model_type} target), which they would not compute"
        )
    state = drafter.state_dict()
    tensors = {"fc.weight": state["context.fc.weight"], "hidden_norm.weight": state["context.norms.0.weight"]}
    tensors.update({name: value for name, value in state.items() if name.startswith(("layers.", "norm."))})
    if config.draft_vocab_size:
        tensors["lm_head.weight"] = state["lm_head.weight"]
        draft_ids = torch.arange(config.draft_vocab_size, device=drafter.draft_to_target.device)
        tensors["d2t"] = drafter.draft_to_target - draft_ids
    return {name: value.detach().contiguous().cpu() for name, value in tensors.items()}


def dflash_config(drafter) -> dict:
    """config.json of the DFlash layout: the target family's layer settings with the drafter's layer count, plus
    `block_size`, `num_target_layers` and `dflash_config` (mask token, 0-based tapped layers)."""
    config = drafter.config
    exported = {
        key: value
        for key, value in config.target_config.items()
        if key not in ("architectures", "auto_map", "_name_or_path", "transformers_version", "layer_types")
    }
    exported.update(
        architectures=["DFlashDraftModel"],
        model_type=config.target_model_type,
        num_hidden_layers=config.num_draft_layers,
        layer_types=["full_attention"] * config.num_draft_layers,
        num_target_layers=config.target_num_hidden_layers,
        block_size=config.block_size,
        dflash_config={"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
        tie_word_embeddings=False,
        dtype=str(drafter.dtype).removeprefix("torch."),
    )
    if config.draft_vocab_size:
        exported["draft_vocab_size"] = config.draft_vocab_size
    return exported


def export_dflash(drafter, directory: str, dtype: torch.dtype | None = None) -> str:
    """Write `model.safetensors` and `config.json` of the DFlash layout into `directory` (in `dtype`, default the
    drafter's); returns the directory. Checked before anything is written."""
    tensors = dflash_tensors(drafter)
    config = dflash_config(drafter)
    if dtype is not None:
        tensors = {name: value if name == "d2t" else value.to(dtype) for name, value in tensors.items()}
        config["dtype"] = str(dtype).removeprefix("torch.")
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
    return directory


EXPORT_FORMATS = {"dflash": export_dflash}
