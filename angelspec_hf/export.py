"""Export a trained drafter to the checkpoint layout serving engines load.

**DFlash** (`DFlashDraftModel`, as z-lab's checkpoints, SpecForge, SGLang `--speculative-algorithm DFLASH` and vLLM
`{"method": "dflash"}` read it): the DFlash configuration of a DFly drafter (`per_layer_context_mix=False`,
`ar_head=False`) computes exactly what that layout does — the context `hidden_norm(fc(concat taps))` of the taps
`hidden_states[i + 1]` for `target_layer_ids` i, fed through every layer's own `k_proj` / `v_proj` / `k_norm` and
RoPE as extra keys and values, the block `[last token, mask…]` through the layers non-causally, `norm`, then the
head — so the export renames tensors and writes the config, nothing else. A reduced draft vocabulary goes out as
`lm_head.weight` with vLLM's `d2t` map (target id = draft id + `d2t[draft id]`); a full one uses the target's head.
The engines build DFlash layers as Qwen3 layers (q/k norms), so only a drafter of a Qwen3-family target exports.

**EAGLE-3** (`LlamaForCausalLMEagle3`, as SpecForge writes it and vLLM `{"method": "eagle3"}` / SGLang
`--speculative-algorithm EAGLE3` read it): an MTP drafter with `input_layout="eagle3"` computes EAGLE-3's midlayer —
`fc` over three tapped target layers, attention over `[input_layernorm(E(x)); hidden_norm(h)]` with h as the residual,
its pre-norm output fed to the next step — so the export renames tensors, orders `fc`'s input blocks by layer, and
writes the config: `eagle_aux_hidden_state_layer_ids` in the engines' indexing (id j = the input of layer j, our
tapped layer j - 1), `draft_vocab_size`, `d2t` and `t2d`. The engines build the midlayer as a Llama layer, so a
drafter whose layers have q/k norms or biases (Qwen2, Qwen3) does not export. The eq. 1 layout (`"projection"`)
attends over `RMSNorm(W_proj[...])` with W_proj's output as the residual, which no renaming turns into EAGLE-3.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def draft_to_target_offsets(drafter) -> torch.Tensor:
    """vLLM's `d2t` map of a reduced draft vocabulary: target id = draft id + d2t[draft id]."""
    draft_ids = torch.arange(drafter.config.draft_vocab_size, device=drafter.draft_to_target.device)
    return drafter.draft_to_target - draft_ids


def target_layer_settings(config) -> dict:
    """The target's config values an exported config starts from (its identity and layer types left out)."""
    skipped = ("architectures", "auto_map", "_name_or_path", "transformers_version", "layer_types")
    return {key: value for key, value in config.target_config.items() if key not in skipped}


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
        tensors["d2t"] = draft_to_target_offsets(drafter)
    return {name: value.detach().contiguous().cpu() for name, value in tensors.items()}


def dflash_config(drafter) -> dict:
    """config.json of the DFlash layout: the target family's layer settings with the drafter's layer count, plus
    `block_size`, `num_target_layers` and `dflash_config` (mask token, 0-based tapped layers)."""
    config = drafter.config
    exported = target_layer_settings(config)
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


def eagle3_tensors(drafter) -> dict[str, torch.Tensor]:
    """The EAGLE-3 layout's tensors, from an MTP drafter with the eagle3 input layout (see the module docstring)."""
    from .models.mtp import AngelSpecMTPConfig

    config = drafter.config
    if not isinstance(config, AngelSpecMTPConfig) or config.input_layout != "eagle3":
        raise ValueError("Only an MTP drafter with input_layout='eagle3' has the EAGLE-3 layout")
    taps, last = config.target_layer_ids, config.target_num_hidden_layers - 1
    if len(taps) != 3 or max(taps) >= last:
        raise ValueError(
            f"EAGLE-3 fuses three target layers below the last (the engines capture each layer's input, not the "
            f"final normed state); target_layer_ids is {taps}"
        )
    if not config.draft_vocab_size:
        raise ValueError("EAGLE-3 checkpoints carry their own draft-vocabulary head: train with a draft_vocab_size")
    attention = drafter.layer.self_attn
    biased = [name for name, module in drafter.layer.named_modules() if getattr(module, "bias", None) is not None]
    if hasattr(attention, "q_norm") or biased:
        raise ValueError(
            f"SGLang and vLLM build the EAGLE-3 midlayer as a Llama layer (no q/k norms, no biases); this drafter's "
            f"is {type(drafter.layer).__name__} ({config.target_model_type} target), which they would not compute"
        )
    state = drafter.state_dict()
    hidden = config.hidden_size
    fc = state["target_fusion.weight"]  # [H, 3H], input blocks in target_layer_ids order; EAGLE-3's go by layer
    blocks = [fc[:, i * hidden : (i + 1) * hidden] for i in sorted(range(3), key=taps.__getitem__)]
    tensors = {
        "fc.weight": torch.cat(blocks, dim=1),
        "midlayer.input_layernorm.weight": state["embed_norm.weight"],
        "midlayer.hidden_norm.weight": state["hidden_norm.weight"],
        "norm.weight": state["norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
        "d2t": draft_to_target_offsets(drafter),
        "t2d": torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, drafter.draft_to_target.cpu(), True),
    }
    tensors.update(
        {f"midlayer.{name[len('layer.') :]}": value for name, value in state.items() if name.startswith("layer.")}
    )
    return {name: value.detach().contiguous().cpu() for name, value in tensors.items()}


def eagle3_config(drafter) -> dict:
    """config.json of the EAGLE-3 layout: the target's layer settings for one Llama midlayer, the draft vocabulary
    and the aux layers in the engines' indexing."""
    config = drafter.config
    exported = target_layer_settings(config)
    aux_layer_ids = sorted(i + 1 for i in config.target_layer_ids)
    exported.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        draft_vocab_size=config.draft_vocab_size,
        target_hidden_size=config.hidden_size,
        eagle_aux_hidden_state_layer_ids=aux_layer_ids,
        eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True},
        tie_word_embeddings=False,
        dtype=str(drafter.dtype).removeprefix("torch."),
    )
    return exported


def with_transformers4_keys(config: dict) -> dict:
    """`config` with the keys serving stacks built on transformers 4 read beside transformers 5's: `torch_dtype`
    (`dtype`), `rope_theta` and, for a scaled RoPE, `rope_scaling` (both in `rope_parameters`)."""
    config["torch_dtype"] = config["dtype"]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    return config


def _write(tensors: dict[str, torch.Tensor], config: dict, directory: str, dtype: torch.dtype | None) -> str:
    """`model.safetensors` (floating tensors in `dtype` when given; index maps keep theirs) and `config.json`."""
    if dtype is not None:
        tensors = {name: value.to(dtype) if value.is_floating_point() else value for name, value in tensors.items()}
        config["dtype"] = str(dtype).removeprefix("torch.")
    config = with_transformers4_keys(config)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
    return directory


def export_dflash(drafter, directory: str, dtype: torch.dtype | None = None) -> str:
    """Write the DFlash layout into `directory` (in `dtype`, default the drafter's); returns the directory. Checked
    before anything is written."""
    return _write(dflash_tensors(drafter), dflash_config(drafter), directory, dtype)


def export_eagle3(drafter, directory: str, dtype: torch.dtype | None = None) -> str:
    """Write the EAGLE-3 layout into `directory` (in `dtype`, default the drafter's); returns the directory. Checked
    before anything is written."""
    return _write(eagle3_tensors(drafter), eagle3_config(drafter), directory, dtype)


EXPORT_FORMATS = {"dflash": export_dflash, "eagle3": export_eagle3}
