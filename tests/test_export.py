"""Export to the DFlash checkpoint layout SGLang and vLLM load: read back, every tensor checked against the drafter's."""

import json

import pytest
import torch
from conftest import make_target
from safetensors.torch import load_file

from angelspec_hf import DFlyDrafter
from angelspec_hf.cli import main
from angelspec_hf.export import export_dflash


def dflash_drafter(target, **overrides):
    torch.manual_seed(0)
    options = dict(block_size=4, num_draft_layers=2, mask_token_id=5, per_layer_context_mix=False, ar_head=False)
    return DFlyDrafter.from_target(target, **{**options, **overrides})


@pytest.mark.parametrize("draft_vocab_size", [None, 32])
def test_the_dflash_export_holds_every_tensor_under_its_dflash_name(tmp_path, draft_vocab_size):
    target = make_target("qwen3", num_hidden_layers=6, dtype=torch.float32)
    drafter = dflash_drafter(target, draft_vocab_size=draft_vocab_size, target_layer_ids=[1, 3, 4])
    if draft_vocab_size:
        drafter.init_draft_vocab(torch.arange(target.config.vocab_size).flip(0).float(), always_keep=[0])
    export_dflash(drafter, tmp_path, dtype=torch.float16)
    tensors = load_file(tmp_path / "model.safetensors")
    state = drafter.state_dict()
    expected = {"fc.weight": state["context.fc.weight"], "hidden_norm.weight": state["context.norms.0.weight"]}
    expected |= {name: value for name, value in state.items() if name.startswith(("layers.", "norm."))}
    if draft_vocab_size:
        expected["lm_head.weight"] = state["lm_head.weight"]
    assert set(tensors) == set(expected) | ({"d2t"} if draft_vocab_size else set())
    for name, value in expected.items():
        assert tensors[name].dtype == torch.float16 and torch.equal(tensors[name], value.half()), name
    assert tensors["fc.weight"].shape == (64, 3 * 64)  # [H, taps·H]
    if draft_vocab_size:  # vLLM's map: target id = draft id + d2t[draft id]
        assert tensors["d2t"].dtype == torch.int64
        assert torch.equal(torch.arange(draft_vocab_size) + tensors["d2t"], drafter.draft_to_target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [1, 3, 4]}
    assert (config["block_size"], config["num_hidden_layers"], config["num_target_layers"]) == (4, 2, 6)
    assert config["layer_types"] == ["full_attention"] * 2 and config["dtype"] == "float16"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert config[key] == getattr(target.config, key), key
    assert config.get("draft_vocab_size") == draft_vocab_size


def test_only_the_dflash_configuration_of_a_qwen3_family_drafter_exports(tmp_path):
    qwen3 = make_target("qwen3", num_hidden_layers=4)
    with pytest.raises(ValueError, match="DFlash configuration"):
        export_dflash(dflash_drafter(qwen3, ar_head=True), tmp_path / "dfly")
    with pytest.raises(ValueError, match="Qwen3 layers"):
        export_dflash(dflash_drafter(make_target("llama", num_hidden_layers=4)), tmp_path / "llama")
    assert not (tmp_path / "dfly").exists() and not (tmp_path / "llama").exists()


def test_the_export_command(tmp_path):
    drafter = dflash_drafter(make_target("qwen3", num_hidden_layers=4, dtype=torch.float32))
    drafter.save_pretrained(tmp_path / "drafter")
    main(["export", "--drafter", str(tmp_path / "drafter"), "--output", str(tmp_path / "out"), "--dtype", "bfloat16"])
    assert load_file(tmp_path / "out" / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
