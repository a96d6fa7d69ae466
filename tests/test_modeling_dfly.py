"""The DFly block-diffusion drafter and its DFlash ablation, on the same spine as MTP."""

import random

import pytest
import torch
from conftest import ARCHITECTURES, make_target
from oracles import OracleDFlyDrafter
from transformers import GenerationConfig
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from angelspec_hf import DFlyDrafter
from angelspec_hf.generation import AngelSpecCandidateGenerator
from angelspec_hf.models.dfly.configuration_dfly import evenly_spaced_layers


VARIANTS = {"dfly": {}, "dflash": {"per_layer_context_mix": False, "ar_head": False}}


def make_dfly(target, cls=DFlyDrafter, **overrides):
    values = dict(block_size=6, num_draft_layers=2, mask_token_id=5, num_target_layers_tapped=2)
    values.update(overrides)
    return cls.from_target(target, **values)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_greedy_output_equals_plain_decoding_for_every_architecture(model_type, variant):
    target = make_target(model_type, num_hidden_layers=4)
    drafter = make_dfly(target, OracleDFlyDrafter, draft_vocab_size=48, **VARIANTS[variant])
    drafter.rng = random.Random(0)
    accepted = 0
    for seed, (prompt_length, new_tokens) in enumerate([(1, 20), (7, 45), (30, 9), (4, 2)]):
        prompt = torch.randint(0, 95, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
        reference = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        drafter.reference = reference
        output = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)
        assert torch.equal(output, reference), f"{model_type}/{variant}: prompt {seed} diverged"
        accepted += sum(drafter.speculation_stats.accepted)
    assert accepted > 15


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_training_blocks_compute_what_inference_drafts(variant):
    """A training block at anchor a (ground-truth predecessors) equals an inference round after a whose drafts are
    the ground truth: the same context, mask, positions and AR-head inputs."""
    target = make_target("llama", seed=2, num_hidden_layers=4)
    drafter = make_dfly(target, **VARIANTS[variant])
    if drafter.ar_head is not None:
        torch.nn.init.normal_(drafter.ar_head.down_proj.weight, std=0.2)  # make the head matter
    sequence = torch.randint(0, 95, (1, 30), generator=torch.Generator().manual_seed(1))
    states = target(sequence, output_hidden_states=True).hidden_states
    hidden = torch.stack([states[i] for i in drafter.training_hidden_state_indices()], dim=1)
    anchor = 17
    drafter.train().sample_anchors = lambda eligible: (torch.tensor([[anchor]]), torch.tensor([[True]]))
    training = drafter(hidden, sequence, torch.arange(30)[None], torch.zeros_like(sequence), torch.ones_like(sequence))
    assert training.draft_positions.tolist() == [1, 2, 3, 4, 5]
    assert training.teacher_positions.tolist() == [anchor, anchor + 1, anchor + 2, anchor + 3, anchor + 4]

    truth = iter(sequence[0, anchor + 1 : anchor + 6].tolist())
    taps = tuple(states[i][:, :anchor] for i in drafter.target_hidden_state_indices())
    _, inference = drafter.propose(
        drafter.new_draft_state(),
        taps,
        sequence[:, 1 : anchor + 1],
        num_tokens=5,
        choose=lambda logits: torch.tensor([next(truth)]),
    )
    torch.testing.assert_close(inference[0], training.logits)


def test_training_blocks_never_see_other_documents_or_later_context():
    drafter = make_dfly(make_target("llama", num_hidden_layers=4), block_size=3)
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    anchors, valid = torch.tensor([[2, 6]]), torch.tensor([[True, True]])
    mask = drafter.training_attention_mask(anchors, valid, documents, drafter.config.block_size)[0, 0]
    context, blocks = mask[:, :8], mask[:, 8:]
    assert context[:3].nonzero()[:, 1].unique().tolist() == [0, 1]  # anchor 2: earlier tokens of document 0
    assert context[3:].nonzero()[:, 1].unique().tolist() == [4, 5]  # anchor 6: earlier tokens of document 1
    assert torch.equal(blocks, torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool())


def test_ablation_switches_give_dflash():
    target = make_target("qwen3", num_hidden_layers=4)
    dflash = make_dfly(target, **VARIANTS["dflash"])
    assert dflash.ar_head is None and dflash.context.layer_mix_logits is None and len(dflash.context.norms) == 1
    dfly = make_dfly(target)
    assert torch.equal(dfly.ar_head.down_proj.weight, torch.zeros_like(dfly.ar_head.down_proj.weight)), (
        "AR head starts as identity"
    )
    assert not dfly.context.layer_mix_logits.any(), "per-layer mix starts uniform"


def test_default_taps_and_position_weights():
    assert evenly_spaced_layers(30, 5) == [1, 8, 14, 20, 27]
    assert evenly_spaced_layers(36, 5) == [1, 9, 17, 25, 33]
    assert evenly_spaced_layers(2, 2) == [1] and evenly_spaced_layers(1, 2) == evenly_spaced_layers(1, 1) == [0]
    drafter = make_dfly(make_target("llama", num_hidden_layers=4), block_size=5, position_decay_gamma=2.0)
    torch.testing.assert_close(drafter.draft_position_weights(), torch.exp(-torch.arange(4.0) / 2.0))


def test_bad_configurations_get_clear_errors():
    target = make_target("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"target_layer_ids \[7\] do not exist"):
        make_dfly(target, target_layer_ids=[1, 7])
    with pytest.raises(ValueError, match="mask_token_id 500 is outside"):
        make_dfly(target, mask_token_id=500)
    with pytest.raises(ValueError, match="exceeds the target context"):
        make_dfly(make_target("llama", num_hidden_layers=4, max_position_embeddings=8), block_size=16)
    with pytest.raises(ValueError, match="needs a mask_token_id"):
        make_dfly(target, mask_token_id=None)


def test_dflash_ablation_runs_through_transformers_builtin_dflash_path():
    """The DFlash configuration also serves transformers' own DFlash generator: same drafts, lossless output."""
    target = make_target("qwen2", num_hidden_layers=4, seed=7)
    drafter = make_dfly(target, **VARIANTS["dflash"])
    adapter = drafter.as_transformers_dflash()
    prompt = torch.randint(0, 95, (1, 9), generator=torch.Generator().manual_seed(3))
    reference = target.generate(prompt, max_new_tokens=25, do_sample=False)
    builtin_output = target.generate(
        prompt, max_new_tokens=25, do_sample=False, assistant_model=adapter, speculation_type="dflash"
    )
    assert torch.equal(builtin_output, reference)

    config = GenerationConfig(max_length=40, do_sample=False)
    builtin = DFlashTokenCandidateGenerator(
        assistant_model=adapter,
        main_model_input_embeddings=target.get_input_embeddings(),
        main_model_output_embeddings=target.get_output_embeddings(),
        generation_config=config,
    )
    drafter.generation_config.num_assistant_tokens_schedule = "constant"  # the full block, as transformers drafts it
    ours = AngelSpecCandidateGenerator(target, drafter, config, prompt)
    prefill = target(prompt, output_hidden_states=True)
    input_ids = torch.cat([prompt, prefill.logits[:, -1:].argmax(-1)], dim=1)
    kwargs = dict(
        model_kwargs={"position_ids": torch.arange(input_ids.shape[1])[None], "attention_mask": None},
        model_outputs=prefill,
        is_first_iteration=False,
        n_last_matches=0,
    )
    builtin_candidates, _ = builtin.get_candidates(input_ids, **kwargs)
    our_candidates, _ = ours.get_candidates(input_ids, **kwargs)
    assert builtin_candidates.shape[1] == input_ids.shape[1] + 5
    assert torch.equal(builtin_candidates, our_candidates)
    with pytest.raises(ValueError, match="DFlash only"):
        make_dfly(target).as_transformers_dflash()
