"""The offline acceptance estimate: the τ greedy speculative decoding measures, from hidden states alone."""

import gzip
import json

import pytest
import torch
from conftest import make_target
from transformers import TrainingArguments

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter
from angelspec_hf.metrics import SpeculationStats
from angelspec_hf.training import AngelSpecTrainer, PackedCollator, build_training_dataset
from angelspec_hf.training.evaluation import AcceptanceEstimate, estimate_acceptance


MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def target():
    # No EOS in the vocabulary's reach: every response runs to max_new_tokens, as most benchmark responses do.
    return make_target("llama", vocab_size=64, seed=11, dtype=torch.float64, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def responses(target, tmp_path_factory):
    """The target's greedy responses to random prompts, in the regenerated-responses format."""
    generator = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("heldout") / "responses.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        for index in range(6):
            prompt = torch.randint(1, 64, (1, 5 + 3 * index), generator=generator)
            output = target.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            record = {
                "source": "random",
                "prompt": str(index),
                "prompt_ids": prompt[0].tolist(),
                "response_ids": output[0, prompt.shape[1] :].tolist(),
            }
            handle.write(json.dumps(record) + "\n")
    return str(path)


def fitted_drafter(family, target, responses, tmp_path):
    """A drafter overfitted to the held-out responses themselves, so that many drafts are accepted."""
    torch.manual_seed(0)
    if family == "mtp":
        drafter = AngelSpecMTPDrafter.from_target(target, num_depths=3)
    else:
        drafter = DFlyDrafter.from_target(
            target, block_size=5, num_draft_layers=1, mask_token_id=1, anchors_per_row=64
        )
    dataset = build_training_dataset(responses, max_length=256)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=2,
        learning_rate=1e-2,
        max_steps=40,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        lr_scheduler_type="constant",
    )
    trainer = AngelSpecTrainer(
        model=drafter,
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset,
        data_collator=PackedCollator(),
        target=target,
    )
    trainer.train()
    drafter.eval().generation_config.num_assistant_tokens_schedule = "constant"
    return drafter, trainer


def generate_stats(target, drafter, responses) -> SpeculationStats:
    pooled = SpeculationStats()
    with gzip.open(responses, "rt") as handle:
        for line in handle:
            record = json.loads(line)
            prompt = torch.tensor([record["prompt_ids"]])
            output = target.generate(prompt, assistant_model=drafter, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            assert output[0, prompt.shape[1] :].tolist() == record["response_ids"]
            pooled = pooled + drafter.speculation_stats
    return pooled


@pytest.mark.parametrize("family", ["mtp", "dfly"])
def test_offline_tau_equals_the_tau_generate_measures(family, target, responses, tmp_path):
    drafter, trainer = fitted_drafter(family, target, responses, tmp_path)
    measured = generate_stats(target, drafter, responses)
    assert measured.tau > 1.5, "the fitted drafter gets drafts accepted: the comparison means something"

    metrics = trainer.evaluate()  # the Trainer's evaluation is the estimate, on the eval dataset
    assert metrics["eval_tau"] == pytest.approx(measured.tau, abs=1e-9)
    assert metrics["eval_rounds"] == measured.target_forwards and metrics["eval_documents"] == 6
    depths = drafter.generation_config.num_assistant_tokens
    for depth, rate in enumerate(measured.acceptance_by_depth()):
        assert metrics[f"eval_acceptance_depth_{depth + 1}"] == pytest.approx(rate, abs=1e-9)
    assert metrics["eval_loss"] > 0 and metrics["eval_tau_depth_1"] <= 2.0
    assert metrics[f"eval_tau_depth_{depths}"] == metrics["eval_tau"]
    for depth in range(1, depths + 1):
        recalls = [metrics[f"eval_recall_top{n}_depth_{depth}"] for n in (1, 2, 4, 8)]
        assert recalls == sorted(recalls) and 0 <= recalls[0] and recalls[-1] <= 1
    assert drafter.training is False, "the estimate restores the drafter's mode"

    drafter.generation_config.num_assistant_tokens = 2  # τ at fewer drafts per round is what generate() sees too
    assert estimate_acceptance(drafter, trainer.get_eval_dataloader(), target)["tau"] == pytest.approx(
        generate_stats(target, drafter, responses).tau, abs=1e-9
    )


def test_rounds_walk_chains_as_generate_does():
    estimate = AcceptanceEstimate(num_draft_tokens=3)
    # Chain lengths from each response position; 7 response tokens, the first from the prefill.
    estimate.chains = [torch.tensor([3, 0, 0, 0, 1, 9, 9])]
    stats = estimate.rounds(3)
    # From 0: 3 accepted + bonus -> 4; from 4: min(1, 6-4-1=1) accepted -> 6 = last.
    assert (stats.drafted, stats.accepted) == ([0, 3, 1], [0, 3, 1])  # the prefill first
    assert estimate.rounds(1).accepted == [0, 1, 0, 0, 1]


def test_lora_adaptation_is_trained_by_the_same_trainer_and_measured_before_and_after(target, responses, tmp_path):
    """A drafter adapted with peft's LoRA to the held-out domain: trained by `AngelSpecTrainer` (base weights
    frozen), its τ measured before and after by the estimate, and the adapted drafter used three ways with the same
    τ: as the `PeftModel`, merged into the drafter, and reloaded as an adapter onto the saved base."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = AngelSpecMTPDrafter.from_target(target, num_depths=3)
    base.generation_config.num_assistant_tokens_schedule = "constant"
    base.save_pretrained(tmp_path / "base")
    frozen = {name: value.clone() for name, value in base.state_dict().items()}
    dataset = build_training_dataset(responses, max_length=256)
    loader_args = dict(per_device_eval_batch_size=2, report_to="none", use_cpu=True, save_strategy="no")
    before = estimate_acceptance(
        base,
        AngelSpecTrainer(
            model=base,
            args=TrainingArguments(output_dir=str(tmp_path / "before"), **loader_args),
            eval_dataset=dataset,
            data_collator=PackedCollator(),
            target=target,
        ).get_eval_dataloader(),
        target,
    )["tau"]

    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=base.lora_target_modules())
    adapted = peft.get_peft_model(base, config)
    args = TrainingArguments(
        output_dir=str(tmp_path / "lora"),
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        max_steps=40,
        lr_scheduler_type="constant",
        seed=0,
        **loader_args,
    )
    trainer = AngelSpecTrainer(
        model=adapted,
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset,
        data_collator=PackedCollator(),
        target=target,
    )
    trainer.train()
    after = trainer.evaluate()["eval_tau"]
    assert after > before + 0.3, (before, after)
    trained_base = {
        name.replace("base_layer.", ""): value
        for name, value in adapted.get_base_model().state_dict().items()
        if "lora_" not in name
    }
    assert trained_base.keys() == frozen.keys()
    assert all(torch.equal(value, frozen[name]) for name, value in trained_base.items()), "LoRA leaves the base"
    assert generate_stats(target, adapted.eval(), responses).tau == pytest.approx(after, abs=1e-9)

    trainer.save_model(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(
        AngelSpecMTPDrafter.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    )
    assert generate_stats(target, reloaded.eval(), responses).tau == pytest.approx(after, abs=1e-9)
    merged = adapted.merge_and_unload()
    assert type(merged) is AngelSpecMTPDrafter
    assert generate_stats(target, merged.eval(), responses).tau == pytest.approx(after, abs=1e-9)
