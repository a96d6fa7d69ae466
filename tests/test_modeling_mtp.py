"""The MTP drafter as a transformers model: Auto classes, checkpoints, target binding, TTT = inference."""

import json
import os

import pytest
import torch
from conftest import ARCHITECTURES, make_target
from transformers import AutoModel

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_drafter_uses_the_decoder_layer_of_the_target_family(model_type):
    target = make_target(model_type)
    drafter = AngelSpecMTPDrafter.from_target(target)
    assert type(drafter.layer).__name__ == type(target.model.layers[0]).__name__
    # The target's embedding and lm_head are borrowed, never parameters of the drafter.
    names = [name for name, _ in drafter.named_parameters()]
    assert not any("embed_tokens" in name for name in names) and "lm_head.weight" not in names


def test_half_precision_checkpoint_drafts_in_the_target_precision(tmp_path):
    target = make_target("llama", dtype=torch.float32)
    AngelSpecMTPDrafter.from_target(target, draft_vocab_size=32).half().save_pretrained(tmp_path)
    drafter = AutoModel.from_pretrained(tmp_path)
    assert drafter.dtype == torch.float16
    prompt = torch.tensor([[5, 6, 7]])
    expected = target.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter), expected)
    assert drafter.dtype == torch.float32


def test_unbound_drafter_explains_how_to_bind():
    drafter = AngelSpecMTPDrafter(AngelSpecMTPDrafter.from_target(make_target("llama")).config)
    with pytest.raises(RuntimeError, match="bind_target"):
        drafter.embed_tokens(torch.tensor([[1]]))


def test_missing_or_corrupt_checkpoint_files_get_clear_errors(tmp_path):
    drafter = AngelSpecMTPDrafter.from_target(make_target("llama"))
    drafter.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="drafter checkpoint"):
        AngelSpecMTPDrafter.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        AutoModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        AngelSpecMTPDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "model_type, target_layer_ids, input_layout",
    [
        ("llama", None, "projection"),
        ("qwen3", None, "projection"),
        ("llama", [0, 1], "projection"),
        ("llama", [0, 1], "eagle3"),
        ("qwen3", None, "eagle3"),
    ],
)
def test_ttt_rollout_computes_what_inference_computes(model_type, target_layer_ids, input_layout):
    """Depth k of the training rollout at slot t equals the k-th draft of an inference round after slot t (with the
    last target layer, or several layers fused, conditioning depth 0; eq. 1's input or EAGLE-3's)."""
    target = make_target(model_type, seed=4)
    drafter = AngelSpecMTPDrafter.from_target(
        target, num_depths=3, draft_vocab_size=48, target_layer_ids=target_layer_ids, input_layout=input_layout
    )
    sequence = torch.randint(0, 95, (1, 24), generator=torch.Generator().manual_seed(0))
    states = target(sequence, output_hidden_states=True).hidden_states
    taps = [states[i] for i in drafter.target_hidden_state_indices()]
    positions = torch.arange(24)[None]
    rollout = drafter.rollout(torch.stack(taps, 1), sequence, positions, torch.zeros_like(sequence))
    for slot in (0, 9, 17):
        state = drafter.new_draft_state()
        _, inference_logits = drafter.propose(
            state,
            tuple(tap[:, : slot + 1] for tap in taps),
            sequence[:, 1 : slot + 2],
            num_tokens=3,
            choose=lambda l: l.argmax(-1),
        )
        for depth in range(3):
            torch.testing.assert_close(inference_logits[:, depth], rollout[depth].logits[:, slot])


def test_ttt_rollout_never_attends_across_packed_documents():
    target = make_target("llama", seed=6)
    drafter = AngelSpecMTPDrafter.from_target(target, num_depths=2)
    first, second = torch.randint(0, 95, (1, 10)), torch.randint(0, 95, (1, 8))
    alone = drafter.rollout(
        target(second, output_hidden_states=True).hidden_states[-1][:, None],
        second,
        torch.arange(8)[None],
        torch.zeros(1, 8, dtype=torch.long),
    )
    packed_ids = torch.cat([first, second], 1)
    positions = torch.cat([torch.arange(10), torch.arange(8)])[None]
    hidden = torch.cat(
        [
            target(first, output_hidden_states=True).hidden_states[-1],
            target(second, output_hidden_states=True).hidden_states[-1],
        ],
        1,
    )
    documents = torch.tensor([[0] * 10 + [1] * 8])
    packed = drafter.rollout(hidden[:, None], packed_ids, positions, documents)
    for depth in range(2):
        torch.testing.assert_close(packed[depth].logits[:, 10:], alone[depth].logits)


def test_no_ttt_ablation_trains_depth_zero_only():
    target = make_target("llama")
    sequence = torch.randint(0, 95, (1, 16))
    hidden = target(sequence, output_hidden_states=True).hidden_states[-1][:, None]
    arguments = (hidden, sequence, torch.arange(16)[None], torch.zeros_like(sequence), torch.ones_like(sequence))
    with_ttt = AngelSpecMTPDrafter.from_target(target, num_depths=3)(*arguments)
    without = AngelSpecMTPDrafter.from_target(target, num_depths=3, training_time_test=False)(*arguments)
    assert with_ttt.draft_positions.unique().tolist() == [1, 2, 3]
    assert without.draft_positions.unique().tolist() == [1]


@pytest.mark.parametrize("zero_output_projections", [False, True])
def test_warm_start_copies_the_targets_last_layers(zero_output_projections):
    target = make_target("qwen3", num_hidden_layers=4)
    drafters = [
        AngelSpecMTPDrafter.from_target(target, num_depths=2),
        DFlyDrafter.from_target(target, num_draft_layers=2, mask_token_id=0),
    ]
    for drafter in drafters:
        drafter.warm_start(target)
        if zero_output_projections:
            drafter.zero_output_projections()
        layers = drafter.draft_layers()
        for draft_layer, target_layer in zip(layers, target.model.layers[-len(layers) :]):
            for (name, draft), (_, original) in zip(
                draft_layer.state_dict().items(), target_layer.state_dict().items()
            ):
                if zero_output_projections and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                    assert not draft.any(), name
                else:
                    torch.testing.assert_close(draft, original, msg=name)
        torch.testing.assert_close(drafter.norm.weight, target.model.norm.weight)


def test_layer_taps_are_checked():
    target = make_target("llama", num_hidden_layers=4)
    for taps in ([4], [1, 1], [3, 0], []):
        with pytest.raises(ValueError, match="target_layer_ids"):
            AngelSpecMTPDrafter.from_target(target, target_layer_ids=taps)
    drafter = AngelSpecMTPDrafter.from_target(target, target_layer_ids=[0, 2, 3])
    assert drafter.target_hidden_state_indices() == [1, 3, 4] == drafter.training_hidden_state_indices()


def test_the_eagle3_layout_reads_embeddings_and_states_in_its_attention():
    """EAGLE-3's midlayer: q/k/v 2H wide, no W_proj, no input norm on the layer; warm_start (H-wide target
    layers) is refused; a bad layout name is refused by the config."""
    target = make_target("llama", num_hidden_layers=4)
    drafter = AngelSpecMTPDrafter.from_target(target, input_layout="eagle3")
    assert drafter.fusion is None and drafter.layer.input_layernorm is None
    assert drafter.layer.self_attn.q_proj.in_features == 2 * target.config.hidden_size
    assert not any(name.startswith(("fusion.", "layer.input_layernorm")) for name in drafter.state_dict())
    with pytest.raises(ValueError, match="eagle3"):
        drafter.warm_start(target)
    with pytest.raises(ValueError, match="input_layout"):
        AngelSpecMTPDrafter.from_target(target, input_layout="eagle")


def test_a_drafter_of_one_layout_starts_a_drafter_of_the_other(tmp_path):
    """`from_other_layout`: the tensors both layouts hold (taps fusion, norms, MLP, o_proj, draft head and vocabulary)
    carry over unchanged, W_proj and the input norm are dropped, q/k/v are fresh and 2H wide; the new drafter saves,
    loads and drafts (greedy output equals the target's); the same layout loads the card as it is."""
    target = make_target("llama", num_hidden_layers=4)
    source = AngelSpecMTPDrafter.from_target(target, target_layer_ids=[0, 2, 3], draft_vocab_size=40)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(torch.randn_like(parameter))  # not the initialisation a fresh drafter would draw
    source.save_pretrained(tmp_path / "projection")
    drafter = AngelSpecMTPDrafter.from_other_layout(tmp_path / "projection", "eagle3")
    assert drafter.config.input_layout == "eagle3" and drafter.fusion is None
    assert drafter.layer.self_attn.q_proj.in_features == 2 * target.config.hidden_size
    before, after = source.state_dict(), drafter.state_dict()
    carried = {name for name in after if name in before and after[name].shape == before[name].shape}
    assert {"target_fusion.weight", "lm_head.weight", "draft_to_target", "layer.self_attn.o_proj.weight"} <= carried
    assert all(torch.equal(after[name], before[name]) for name in carried)
    assert set(after) - carried == {f"layer.self_attn.{name}_proj.weight" for name in "qkv"}
    drafter.save_pretrained(tmp_path / "eagle3")
    loaded = AngelSpecMTPDrafter.from_pretrained(tmp_path / "eagle3")
    prompt = torch.tensor([[5, 6, 7]])
    expected = target.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=loaded), expected)
    same = AngelSpecMTPDrafter.from_other_layout(tmp_path / "eagle3", "eagle3")
    assert all(torch.equal(value, same.state_dict()[name]) for name, value in loaded.state_dict().items())
    back = AngelSpecMTPDrafter.from_other_layout(tmp_path / "eagle3", "projection")
    assert back.fusion is not None and torch.equal(back.lm_head.weight, loaded.lm_head.weight)


def glm_target_with_native_mtp(directory, hidden_states_first=False):
    """A tiny GLM-4.5-Air-shaped target (46 layers, MoE) whose checkpoint carries a native MTP module at layer 46,
    in the layout of the real checkpoints (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm` beside the block)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    moe = dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        n_group=1,
        topk_group=1,
    )
    with_block = make_target("glm4_moe", dtype=torch.float32, num_hidden_layers=47, first_k_dense_replace=1, **moe)
    with_block.save_pretrained(directory)  # layer 46 is the MTP block
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(1)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.46.{name}.weight"] = 1 + 0.1 * torch.randn(64, generator=generator)
    tensors["model.layers.46.eh_proj.weight"] = 0.1 * torch.randn(64, 128, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as handle:
        config = json.load(handle)
    config.update(num_hidden_layers=46, num_nextn_predict_layers=1, mtp_hidden_states_first=hidden_states_first)
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(config, handle)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval().requires_grad_(False)


@pytest.mark.parametrize("hidden_states_first", [False, True])
def test_warm_start_from_a_native_mtp_layer_drafts_as_it_does(tmp_path, hidden_states_first):
    """Started from a target's own MTP module (loaded by transformers' `MtpModel`), depth 0 gives exactly the native
    module's logits on every position, whichever order the native projection reads its inputs in; and the drafter
    decodes losslessly with the MoE block as its layer."""
    from transformers.modeling_layers import MtpModel

    target = glm_target_with_native_mtp(tmp_path, hidden_states_first)
    drafter = AngelSpecMTPDrafter.from_native_mtp(target, num_depths=2)
    assert type(drafter.layer.mlp).__name__ == "Glm4MoeMoE"  # built as the MTP block, not as layer 0 (dense)
    native = MtpModel.from_pretrained(target)
    sequence = torch.randint(0, 95, (1, 12), generator=torch.Generator().manual_seed(2))
    final = target(sequence, output_hidden_states=True).hidden_states[-1]
    positions = torch.arange(1, 12)[None]
    with torch.no_grad():
        ours = drafter.step(final[:, :-1], sequence[:, 1:], positions).logits
        layer = native.layers[0]
        hidden = layer(
            native.embed_tokens(sequence[:, 1:]),
            final[:, :-1],
            position_embeddings=native.rotary_emb(final, positions),
            attention_mask=None,
            position_ids=positions,
            past_key_values=None,
        )
        torch.testing.assert_close(ours, native._project_to_logits(hidden))
    prompt = torch.tensor([[3, 5, 7, 9]])
    expected = target.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=drafter), expected)


def test_a_native_mtp_warm_start_needs_a_native_layer_and_its_shape():
    target = make_target("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match="no native MTP layer"):
        AngelSpecMTPDrafter.from_native_mtp(target)
    target.config.num_mtp_layers = 1
    with pytest.raises(ValueError, match="full vocabulary"):
        AngelSpecMTPDrafter.from_native_mtp(target, draft_vocab_size=32)
    with pytest.raises(ValueError, match="projection"):
        AngelSpecMTPDrafter.from_native_mtp(target, input_layout="eagle3")
