"""Export to the DFlash and EAGLE-3 checkpoint layouts SGLang and vLLM load: read back, every tensor checked against
the drafter's, and the EAGLE-3 export recomputed from its tensors alone."""

import json
import os

import pytest
import torch
from conftest import make_target
from safetensors.torch import load_file

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter
from angelspec_hf.cli import main
from angelspec_hf.export import export_dflash, export_eagle3


EAGLE3_CARD = "smollm2-135m-instruct-mtp-eagle3"  # the MTP trained in EAGLE-3's input layout


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
    assert config["torch_dtype"] == "float16"  # and the transformers-4 keys serving stacks read
    assert (
        config["rope_theta"] == config["rope_parameters"]["rope_theta"] == target.config.rope_parameters["rope_theta"]
    )
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


def eagle3_drafter(target, **overrides):
    torch.manual_seed(0)
    options = dict(num_depths=3, input_layout="eagle3", target_layer_ids=[3, 1, 4], draft_vocab_size=40)
    drafter = AngelSpecMTPDrafter.from_target(target, **{**options, **overrides})
    if drafter.config.draft_vocab_size:
        drafter.init_draft_vocab(torch.arange(target.config.vocab_size).flip(0).float(), always_keep=[0])
    with torch.no_grad():  # norms away from 1, so that a norm read under the wrong name shows
        for name, parameter in drafter.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return drafter


def reference_eagle3_step(tensors, config, embeds, hidden, past_keys, past_values, position):
    """One EAGLE-3 step for one new position, written from the exported tensors and config alone (plain torch, as
    the engines' Llama midlayer computes it): returns draft logits, the pre-norm state and the grown key/value lists."""

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])

    def rope(x):  # x [heads, head_dim] at `position`
        half = x.shape[-1] // 2
        inverse = 1.0 / config["rope_parameters"]["rope_theta"] ** (torch.arange(0, half, dtype=x.dtype) / half)
        angles = torch.cat([position * inverse] * 2)
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * angles.cos() + rotated * angles.sin()

    layer = "midlayer."
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    wide = torch.cat(
        [rms(embeds, tensors[layer + "input_layernorm.weight"]), rms(hidden, tensors[layer + "hidden_norm.weight"])]
    )
    query = rope((tensors[layer + "self_attn.q_proj.weight"] @ wide).view(heads, head_dim))
    past_keys = past_keys + [rope((tensors[layer + "self_attn.k_proj.weight"] @ wide).view(kv_heads, head_dim))]
    past_values = past_values + [(tensors[layer + "self_attn.v_proj.weight"] @ wide).view(kv_heads, head_dim)]
    keys, values = torch.stack(past_keys, 1), torch.stack(past_values, 1)  # [kv_heads, T, head_dim]
    group = heads // kv_heads
    scores = torch.einsum("hd,htd->ht", query, keys.repeat_interleave(group, 0)) / head_dim**0.5
    attended = torch.einsum("ht,htd->hd", scores.softmax(-1), values.repeat_interleave(group, 0)).reshape(-1)
    hidden = hidden + tensors[layer + "self_attn.o_proj.weight"] @ attended
    normed = rms(hidden, tensors[layer + "post_attention_layernorm.weight"])
    gate, up = tensors[layer + "mlp.gate_proj.weight"] @ normed, tensors[layer + "mlp.up_proj.weight"] @ normed
    hidden = hidden + tensors[layer + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
    return tensors["lm_head.weight"] @ rms(hidden, tensors["norm.weight"]), hidden, past_keys, past_values


def test_the_eagle3_export_computes_the_drafters_drafts(tmp_path):
    """Read back, the EAGLE-3 export drafts what the drafter drafts: a plain-torch EAGLE-3 step over the exported
    tensors (fc over the aux layers in the engines' indexing and order, the midlayer, norm, lm_head, then d2t) gives
    the drafter's own draft chain and logits, for a prompt and three chained depths."""
    target = make_target("llama", num_hidden_layers=6, dtype=torch.float64)
    drafter = eagle3_drafter(target)
    export_eagle3(drafter, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # id j = the input of layer j = our layer j - 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert (config["num_hidden_layers"], config["draft_vocab_size"]) == (1, 40)
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["d2t"].dtype == torch.int64
    assert torch.equal(torch.arange(40) + tensors["d2t"], drafter.draft_to_target)
    assert tensors["t2d"].sum() == 40 and tensors["t2d"][drafter.draft_to_target].all()
    own = {name for name in drafter.state_dict() if name != "draft_to_target"}
    assert len(tensors) == len(own) + 2  # every drafter tensor once, plus d2t and t2d

    prompt = torch.randint(0, 95, (1, 9), generator=torch.Generator().manual_seed(1))
    assert_the_export_drafts_as_the_drafter(drafter, target, tensors, config, prompt)


def assert_the_export_drafts_as_the_drafter(drafter, target, tensors, config, prompt, **tolerance):
    """A plain-torch EAGLE-3 pass over the exported tensors, prefilled with `prompt`, chains three drafts: the same
    tokens and logits as `drafter.propose` on the same target states."""
    depths, length = 3, prompt.shape[1] - 1
    states = target(prompt, output_hidden_states=True).hidden_states
    # The engines capture each aux layer's input: hidden_states[j] for id j, concatenated in id order.
    aux = torch.cat([states[j][0] for j in config["eagle_aux_hidden_state_layer_ids"]], -1)
    fused = aux @ tensors["fc.weight"].T
    embed = target.get_input_embeddings().weight
    keys, values = [], []
    for position in range(length):  # prefill: state t with token t + 1
        logits, hidden, keys, values = reference_eagle3_step(
            tensors, config, embed[prompt[0, position + 1]], fused[position], keys, values, position + 1
        )
    chain, chain_logits = [], []
    for depth in range(depths):
        token = int(logits.argmax()) + int(tensors["d2t"][logits.argmax()])
        chain.append(token)
        chain_logits.append(logits)
        if depth < depths - 1:
            logits, hidden, keys, values = reference_eagle3_step(
                tensors, config, embed[token], hidden, keys, values, length + 1 + depth
            )
    taps = tuple(states[i] for i in drafter.target_hidden_state_indices())
    draft_ids, draft_logits = drafter.propose(
        drafter.new_draft_state(), tuple(t[:, :length] for t in taps), prompt[:, 1:], depths, lambda l: l.argmax(-1)
    )
    assert draft_ids[0].tolist() == chain
    torch.testing.assert_close(draft_logits[0], torch.stack(chain_logits), **tolerance)


def test_only_an_eagle3_mtp_drafter_of_a_llama_layer_exports(tmp_path):
    llama = make_target("llama", num_hidden_layers=6)
    refusals = [
        (eagle3_drafter(llama, input_layout="projection"), "input_layout='eagle3'"),
        (eagle3_drafter(llama, target_layer_ids=[1, 3, 5]), "three target layers below the last"),
        (eagle3_drafter(llama, target_layer_ids=[1, 3]), "three target layers"),
        (eagle3_drafter(llama, draft_vocab_size=None), "draft_vocab_size"),
        (eagle3_drafter(make_target("qwen3", num_hidden_layers=6)), "Llama layer"),
        (eagle3_drafter(make_target("qwen2", num_hidden_layers=6)), "Llama layer"),
    ]
    for drafter, message in refusals:
        with pytest.raises(ValueError, match=message):
            export_eagle3(drafter, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="DFlash configuration"):
        export_dflash(eagle3_drafter(llama), tmp_path / "out")


def test_the_eagle3_export_command(tmp_path, capsys):
    eagle3_drafter(make_target("llama", num_hidden_layers=6, dtype=torch.float32)).save_pretrained(tmp_path / "d")
    main(["export", "--drafter", str(tmp_path / "d"), "--format", "eagle3", "--output", str(tmp_path / "out")])
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.float32 and tensors["d2t"].dtype == torch.int64
    with pytest.raises(SystemExit):
        main(["export", "--drafter", str(tmp_path / "d"), "--format", "dflash", "--output", str(tmp_path / "x")])
    assert "DFlash configuration" in capsys.readouterr().err


@pytest.mark.slow
def test_the_shipped_eagle3_mtp_exports_and_its_export_drafts_as_it_does(tmp_path):
    """The MTP card trained in EAGLE-3's layout, on the real target: `angelspec export --format eagle3` writes it, and
    a plain-torch EAGLE-3 pass over the exported files alone drafts the card's own three tokens and logits."""
    from angelspec_hf import load_drafter, load_target
    from angelspec_hf.prompts import encode_chat

    card = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_cards", EAGLE3_CARD)
    target = load_target("smollm2", tune_kernels=False)
    main(["export", "--drafter", card, "--format", "eagle3", "--output", str(tmp_path / "out")])
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and config["draft_vocab_size"] == 8192
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]  # what engines on transformers 4 read
    drafter = load_drafter(card, target.model, target.tokenizer)
    tensors = {
        name: value.to(torch.float32) if value.is_floating_point() else value for name, value in tensors.items()
    }
    prompt = torch.tensor([encode_chat(target.tokenizer, "Write a haiku about the sea.")])
    with torch.no_grad():
        assert_the_export_drafts_as_the_drafter(drafter, target.model, tensors, config, prompt, rtol=1e-4, atol=1e-4)
