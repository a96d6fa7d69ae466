"""TTT training with the Trainer: data, online/offline hidden states, acceptance callback, resume, CPU DDP."""

import gzip
import importlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModel, AutoTokenizer, TrainingArguments

from angelspec_hf import AngelSpecMTPDrafter
from angelspec_hf.prompts import encode_chat, load_prompts
from angelspec_hf.training import (
    AcceptanceCallback,
    AngelSpecTrainer,
    PackedCollator,
    build_training_dataset,
    precompute_hidden_states,
)
from angelspec_hf.training.precision import MIN_SPEEDUP, Bf16Choice
from angelspec_hf.training.regenerate import mean_attended_context, read_responses, regenerate_responses


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def example(name: str):
    """A script of examples/ as a module (they are not a package)."""
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.fixture(scope="module")
def responses(chat_target, smollm2_tokenizer, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data") / "responses.jsonl.gz")
    regenerate_responses(
        chat_target,
        smollm2_tokenizer,
        ["alpaca_eval", "self_instruct"],
        path,
        limit_per_source=6,
        max_new_tokens=24,
        batch_size=4,
    )
    return path


def test_regeneration_is_resumable_and_records_the_target_output(chat_target, smollm2_tokenizer, responses):
    records = read_responses(responses)
    assert len(records) == 12 and {r["source"] for r in records} == {"alpaca_eval", "self_instruct"}
    with open(responses, "rb") as handle:  # appended a gzip member per step that kept something, then rewritten
        assert handle.read().count(b"\x1f\x8b\x08") == 1, "one gzip stream once the run is done"
    first = records[0]
    assert first["prompt_ids"] == encode_chat(smollm2_tokenizer, first["prompt"])
    solo = chat_target.generate(torch.tensor([first["prompt_ids"]]), max_new_tokens=24, do_sample=False)
    assert solo[0, len(first["prompt_ids"]) :].tolist()[: len(first["response_ids"])] == first["response_ids"]
    again = regenerate_responses(chat_target, smollm2_tokenizer, ["alpaca_eval"], responses, limit_per_source=6)
    assert len(again) == 12, "prompts already answered are not regenerated"


def test_a_regeneration_killed_mid_write_keeps_its_records_and_resumes(
    chat_target, smollm2_tokenizer, tmp_path, package_log
):
    path = str(tmp_path / "cut.jsonl.gz")
    kwargs = dict(limit_per_source=3, max_new_tokens=8, batch_size=2)
    first = regenerate_responses(chat_target, smollm2_tokenizer, ["alpaca_eval"], path, **kwargs)
    whole = open(path, "rb").read()
    record = {**first[0], "prompt": "cut off", "response_ids": list(range(3000))}
    with gzip.open(path, "at", encoding="utf-8") as handle:  # a last append, then the process killed mid-write
        handle.write(json.dumps(record) + "\n")
    with open(path, "r+b") as handle:
        handle.truncate(len(whole) + (os.path.getsize(path) - len(whole)) // 2)
    with package_log.warns("cut-off append"):
        assert read_responses(path) == first
    with package_log.warns("cut-off append"):
        regenerate_responses(
            chat_target, smollm2_tokenizer, ["alpaca_eval"], path, **{**kwargs, "limit_per_source": 4}
        )
    with package_log.silent():  # the resumed run rewrote the file before appending to it
        again = read_responses(path)
    assert again[:3] == first and len(again) == 4


def test_regeneration_into_xz_resumes_survives_a_cut_off_append_and_ends_in_one_stream(
    chat_target, smollm2_tokenizer, tmp_path, package_log
):
    """`.jsonl.xz` files: each append an xz stream, read as one file; a run rewrites its file as one stream."""
    path = str(tmp_path / "responses.jsonl.xz")
    kwargs = dict(limit_per_source=3, max_new_tokens=6, batch_size=2, temperature=1.0, seed=[100, 200])
    first = regenerate_responses(chat_target, smollm2_tokenizer, ["alpaca_eval"], path, **kwargs)
    assert len(first) == 6 and open(path, "rb").read().count(b"\xfd7zXZ\x00") == 1
    gzipped = str(tmp_path / "responses.jsonl.gz")
    assert regenerate_responses(chat_target, smollm2_tokenizer, ["alpaca_eval"], gzipped, **kwargs) == first, (
        "the same records in either format (sampled with their seeds)"
    )
    whole = os.path.getsize(path)
    with lzma.open(path, "at", encoding="utf-8") as handle:  # an append cut off mid-write
        handle.write(json.dumps({**first[0], "prompt": "cut off", "response_ids": list(range(3000))}) + "\n")
    with open(path, "r+b") as handle:
        handle.truncate(whole + (os.path.getsize(path) - whole) // 2)
    with package_log.warns("cut-off append"):
        assert read_responses(path) == first
    with package_log.warns("cut-off append"):
        again = regenerate_responses(
            chat_target, smollm2_tokenizer, ["alpaca_eval"], path, **{**kwargs, "limit_per_source": 4}
        )
    assert again[:6] == first and len(again) == 8
    assert read_responses(f"{path},{gzipped}") == again + first


def test_sampled_regeneration_records_its_seeds_and_resumes(chat_target, smollm2_tokenizer, tmp_path):
    path = str(tmp_path / "sampled.jsonl.gz")
    kwargs = dict(limit_per_source=3, max_new_tokens=8, batch_size=2, temperature=1.0, seed=100)
    first = regenerate_responses(chat_target, smollm2_tokenizer, ["alpaca_eval"], path, **kwargs)
    assert sorted(record["seed"] for record in first) == [100, 101, 102]
    assert regenerate_responses(chat_target, smollm2_tokenizer, ["alpaca_eval"], path, **kwargs) == first, (
        "resumed: nothing new"
    )
    second = regenerate_responses(chat_target, smollm2_tokenizer, ["alpaca_eval"], path, **{**kwargs, "seed": 200})
    assert len(second) == 6, "another seed is another pass over the same prompts"


def test_a_dialogues_later_turns_are_regenerated_after_the_turns_before_them(chat_target, smollm2_tokenizer, tmp_path):
    rows = load_prompts("mtbench101_later_turns")  # 4 dialogues of 3, 4, 3 and 3 turns in the fixture
    assert len(rows) == 2 + 3 + 2 + 2 and [len(row["history"]) for row in rows][:3] == [2, 4, 2]
    first, second = rows[0], rows[1]
    assert second["history"][:2] == first["history"] and second["history"][2]["content"] == first["prompt"]
    assert second["history"][3]["role"] == "assistant", "the dialogue's own answer follows each user turn"
    path = str(tmp_path / "turns.jsonl.gz")
    kwargs = dict(limit_per_source=4, max_new_tokens=4, batch_size=2)
    records = regenerate_responses(chat_target, smollm2_tokenizer, ["mtbench101_later_turns"], path, **kwargs)
    by_prompt = {record["prompt"]: record for record in records}  # in the order they finished
    assert len(records) == 4 and set(by_prompt) == set(rows.select(range(4))["prompt"])
    for row in rows.select(range(4)):
        assert by_prompt[row["prompt"]]["prompt_ids"] == encode_chat(smollm2_tokenizer, row["prompt"], row["history"])
    text = smollm2_tokenizer.decode(by_prompt[second["prompt"]]["prompt_ids"])
    assert text.index(first["history"][0]["content"]) < text.index(first["prompt"]) < text.index(second["prompt"])
    assert len({record["context"] for record in records}) == 4
    again = regenerate_responses(chat_target, smollm2_tokenizer, ["mtbench101_later_turns"], path, **kwargs)
    assert again == records, "resumed: every turn already answered"


def test_several_seeds_are_several_sampled_passes_in_one_run(chat_target, smollm2_tokenizer, tmp_path):
    kwargs = dict(limit_per_source=3, max_new_tokens=8, batch_size=2, temperature=1.0)
    apart = []
    for seed in (100, 200):
        apart += regenerate_responses(
            chat_target, smollm2_tokenizer, ["alpaca_eval"], str(tmp_path / f"{seed}.jsonl.gz"), seed=seed, **kwargs
        )
    together = regenerate_responses(
        chat_target, smollm2_tokenizer, ["alpaca_eval"], str(tmp_path / "both.jsonl.gz"), seed=[100, 200], **kwargs
    )
    assert sorted(r["seed"] for r in together) == [100, 101, 102, 200, 201, 202]
    by_seed = {r["seed"]: r for r in apart}
    for record in together:  # the same responses, a prompt's two samples made from one prefill
        assert record == by_seed[record["seed"]]
    assert len({tuple(r["response_ids"]) for r in together}) > 3


def test_regeneration_decodes_prompts_of_about_one_length_together(
    chat_target, smollm2_tokenizer, tmp_path, monkeypatch
):
    """Requests go to the engine shortest prompt first (rows decoded together attend over the longest row's
    columns), a prompt's samples one after the other (they share its prefill)."""
    from angelspec_hf.generation.engine import SpeculativeEngine

    submitted = []
    submit = SpeculativeEngine.submit
    monkeypatch.setattr(
        SpeculativeEngine, "submit", lambda self, request: submitted.append(request) or submit(self, request)
    )
    path = str(tmp_path / "sorted.jsonl.gz")
    kwargs = dict(limit_per_source=4, max_new_tokens=2, batch_size=2, temperature=1.0, seed=[100, 200])
    records = regenerate_responses(chat_target, smollm2_tokenizer, ["alpaca_eval", "self_instruct"], path, **kwargs)
    lengths = [len(request.input_ids) for request in submitted]
    by_length = sorted(len(record["prompt_ids"]) for record in records)
    assert len(submitted) == 16 and lengths == by_length and len(set(lengths)) > 2, "shortest prompts first"
    assert all(first.input_ids == second.input_ids for first, second in zip(submitted[::2], submitted[1::2]))


def test_the_mean_attended_context_of_responses():
    records = [{"prompt_ids": [1] * 10, "response_ids": [2] * 4}, {"prompt_ids": [1] * 100, "response_ids": [2] * 12}]
    # per generated token: 4 tokens at 10 + 2, 12 at 100 + 6
    assert mean_attended_context(records) == round((4 * 12 + 12 * 106) / 16)
    assert mean_attended_context([]) == 0


def test_regeneration_skips_the_prompts_of_excluded_sets(chat_target, smollm2_tokenizer, tmp_path):
    path = str(tmp_path / "excluded.jsonl.gz")
    kwargs = dict(limit_per_source=2, max_new_tokens=4, batch_size=2)
    records = regenerate_responses(
        chat_target, smollm2_tokenizer, ["alpaca_eval", "self_instruct"], path, exclude=["self_instruct"], **kwargs
    )
    assert sorted(r["prompt"] for r in records) == sorted(
        row["prompt"] for row in load_prompts("alpaca_eval", limit=2)
    )


def test_teacher_forced_responses_read_answers_and_python_sources(smollm2_tokenizer, tmp_path):
    from angelspec_hf.prompts import load_references
    from angelspec_hf.training.regenerate import teacher_forced_responses

    package = tmp_path / "package"
    package.mkdir()
    source = "def add(a, b):\n    return a + b\n" * 40
    (package / "module.py").write_text(source)
    (package / "notes.txt").write_text("not python")
    path = str(tmp_path / "tf.jsonl.gz")
    records = teacher_forced_responses(
        smollm2_tokenizer, ["gsm8k_train"], path, limit_per_source=2, python_source=str(package), chunk_tokens=64
    )
    answers = load_references("gsm8k_train", limit=2)
    math = [record for record in records if record["source"] == "gsm8k_train"]
    assert [r["prompt"] for r in math] == [a["prompt"] for a in answers]
    assert math[0]["prompt_ids"] == encode_chat(smollm2_tokenizer, answers[0]["prompt"])
    assert smollm2_tokenizer.decode(math[0]["response_ids"][:-1]) == answers[0]["reference"]
    assert math[0]["response_ids"][-1] == smollm2_tokenizer.eos_token_id, "the answer closes its turn"
    code = [record for record in records if record["source"] == "python_source"]
    assert code and all(r["prompt_ids"] == [] and 32 <= len(r["response_ids"]) <= 64 for r in code)
    assert smollm2_tokenizer.decode([t for r in code for t in r["response_ids"]]).startswith(source[:200])
    assert read_responses(path) == records
    with pytest.raises(ValueError, match="has no reference answers"):
        load_references("mt_bench")


def test_packing_keeps_documents_apart_and_loss_on_responses_only(responses):
    records = read_responses(responses)
    dataset = build_training_dataset(responses, max_length=96)
    assert sum(sum(row["loss_mask"]) for row in dataset) == sum(
        max(0, min(len(r["prompt_ids"]) + len(r["response_ids"]), 96) - len(r["prompt_ids"])) for r in records
    )
    assert all(any(row["loss_mask"]) for row in dataset), "conversations truncated before their response are dropped"
    for row in dataset:
        assert len(row["input_ids"]) <= 96
        documents, positions = torch.tensor(row["document_ids"]), torch.tensor(row["position_ids"])
        starts = torch.cat([torch.tensor([True]), documents[1:] != documents[:-1]])
        assert torch.equal(positions == 0, starts), "positions restart exactly at each document"


def make_trainer(target, tokenizer, dataset, output_dir, drafter_options=None, **overrides):
    torch.manual_seed(0)  # same initial drafter every time
    options = dict(num_depths=3, draft_vocab_size=512, **(drafter_options or {}))
    drafter = AngelSpecMTPDrafter.from_target(target, tokenizer, **options)
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        max_steps=6,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        lr_scheduler_type="constant",
    )
    values.update(overrides)
    return AngelSpecTrainer(
        model=drafter,
        args=TrainingArguments(**values),
        train_dataset=dataset,
        data_collator=PackedCollator(),
        target=target,
    )


def test_offline_hidden_states_give_the_same_loss_as_online(chat_target, smollm2_tokenizer, responses, tmp_path):
    dataset = build_training_dataset(responses, max_length=128)
    offline = precompute_hidden_states(
        dataset, chat_target, [chat_target.config.num_hidden_layers], str(tmp_path), dtype="float32"
    )
    trainer = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path / "out")
    rows = [dataset[i] for i in range(2)]
    online_batch = PackedCollator()(rows)
    offline_batch = PackedCollator()([offline[i] for i in range(2)])
    assert "target_hidden" in offline_batch and "target_hidden" not in online_batch
    torch.manual_seed(0)
    online_loss = trainer.compute_loss(trainer.model, online_batch)
    offline_loss = trainer.compute_loss(trainer.model, offline_batch)
    assert online_loss.item() > 0
    torch.testing.assert_close(online_loss, offline_loss, rtol=1e-5, atol=1e-5)
    # A cache of more layers serves the drafter through the collator's selection.
    layers = chat_target.config.num_hidden_layers
    wider = precompute_hidden_states(dataset, chat_target, [1, layers], str(tmp_path / "wider"), dtype="float32")
    selected = PackedCollator(select=[1])([wider[i] for i in range(2)])
    torch.testing.assert_close(selected["target_hidden"], offline_batch["target_hidden"])


def test_hidden_states_computed_under_bf16_are_a_cache_of_their_own(chat_target, responses, tmp_path):
    """`compute_dtype="bfloat16"` (the target under bf16 autocast, issue 36) writes a cache beside the float32 one,
    never read for it, close to it within bf16's precision; a precision it does not know is refused first."""
    dataset = build_training_dataset(responses, max_length=128)
    layers = [chat_target.config.num_hidden_layers]
    exact = precompute_hidden_states(dataset, chat_target, layers, str(tmp_path), dtype="float32")
    bf16 = precompute_hidden_states(
        dataset, chat_target, layers, str(tmp_path), dtype="float32", compute_dtype="bfloat16"
    )
    assert len(list(tmp_path.glob("*.json"))) == 2
    exact_rows, bf16_rows = (torch.cat([d[i]["target_hidden"] for i in range(2)]) for d in (exact, bf16))
    assert not torch.equal(exact_rows, bf16_rows)
    torch.testing.assert_close(bf16_rows, exact_rows, rtol=0.05, atol=0.05 * exact_rows.abs().max().item())
    again = precompute_hidden_states(dataset, chat_target, layers, str(tmp_path), dtype="float32")
    assert torch.equal(torch.cat([again[i]["target_hidden"] for i in range(2)]), exact_rows)
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        precompute_hidden_states(dataset, chat_target, layers, str(tmp_path), compute_dtype="float16")


def test_a_bf16_run_computes_the_whole_loss_under_autocast(chat_target, smollm2_tokenizer, responses, tmp_path):
    """With `bf16=True` the teacher's head and the loss run under autocast too, not only the drafter's forward that
    accelerate wraps (on a CPU they are a large part of a step); without it, nothing does."""
    dataset = build_training_dataset(responses, max_length=128)
    batch = PackedCollator()([dataset[i] for i in range(2)])
    for bf16 in (False, True):
        trainer = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path / str(bf16), bf16=bf16)
        drafter, seen = trainer.drafter, []
        head = drafter.target_head_logits
        drafter.target_head_logits = lambda states: seen.append(torch.is_autocast_enabled("cpu")) or head(states)
        loss = trainer.compute_loss(trainer.model, batch)
        assert seen == [bf16] and torch.isfinite(loss)


def test_feature_regression_and_feature_noise_enter_the_loss(chat_target, smollm2_tokenizer, responses, tmp_path):
    from angelspec_hf.training.data import target_hidden_states
    from angelspec_hf.training.losses import feature_regression_loss

    dataset = build_training_dataset(responses, max_length=128)
    batch = PackedCollator()([dataset[i] for i in range(2)])
    trainer = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path)
    config = trainer.drafter.config
    plain = trainer.compute_loss(trainer.model, batch)
    config.hidden_regression_weight = 0.5
    loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    (final,) = target_hidden_states(
        chat_target, batch["input_ids"], batch["position_ids"], [chat_target.config.num_hidden_layers]
    )
    expected = plain + 0.5 * feature_regression_loss(
        outputs.hidden_states, final.flatten(0, 1)[outputs.teacher_positions]
    )
    torch.testing.assert_close(loss, expected)
    config.hidden_regression_weight, config.hidden_noise_std = 0.0, 0.3
    _, clean = trainer.compute_loss(trainer.model.eval(), batch, return_outputs=True)
    _, noised = trainer.compute_loss(trainer.model.train(), batch, return_outputs=True)
    assert (noised.logits - clean.logits).abs().max() > 1e-3, "training reads noised states"
    torch.testing.assert_close(clean.logits, outputs.logits, msg="no noise outside training")


def test_training_lowers_the_loss_and_logs_real_acceptance(chat_target, smollm2_tokenizer, responses, tmp_path):
    dataset = build_training_dataset(responses, max_length=128)
    prompts = [
        torch.tensor([encode_chat(smollm2_tokenizer, row["prompt"])]) for row in load_prompts("mt_bench", limit=2)
    ]
    callback = AcceptanceCallback(chat_target, prompts, max_new_tokens=8, every_n_steps=10)
    trainer = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path, max_steps=20)
    trainer.add_callback(callback)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0]
    logged = [entry for entry in trainer.state.log_history if "accept/tau" in entry]
    assert logged and all(1.0 <= entry["accept/tau"] <= 4.0 for entry in logged)
    assert {"accept/depth_1", "top1_agreement_position_3"} <= set().union(*trainer.state.log_history)


def test_the_eagle3_layout_trains_with_the_same_trainer(chat_target, smollm2_tokenizer, responses, tmp_path):
    dataset = build_training_dataset(responses, max_length=128)
    layout = dict(input_layout="eagle3", target_layer_ids=[0, 1])
    trainer = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path, drafter_options=layout, max_steps=12)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0]


def test_a_cpu_budget_stops_training_with_a_save_and_counts_across_resumption(
    chat_target, smollm2_tokenizer, responses, tmp_path
):
    from angelspec_hf.training import CpuClockCallback

    dataset = build_training_dataset(responses, max_length=128)
    trainer = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path, save_strategy="steps", save_steps=100)
    trainer.add_callback(CpuClockCallback(max_cpu_minutes=0.0))
    trainer.train()
    assert trainer.state.global_step == 1 and os.path.isdir(tmp_path / "checkpoint-1")
    first = [entry["cpu_hours"] for entry in trainer.state.log_history if "cpu_hours" in entry]
    assert first and first[-1] > 0

    # Resumed with a budget left, the clock goes on from what the checkpoint logged, and stops at the budget.
    with open(tmp_path / "checkpoint-1" / "trainer_state.json") as handle:
        saved = [entry["cpu_hours"] for entry in json.load(handle)["log_history"] if "cpu_hours" in entry]
    budget = 60 * saved[-1] + 1e-3
    # far more steps than that budget's 0.06 CPU-seconds allow, however fast this machine is: the budget stops it
    resumed = make_trainer(
        chat_target, smollm2_tokenizer, dataset, tmp_path, save_strategy="steps", save_steps=1000, max_steps=200
    )
    resumed.add_callback(CpuClockCallback(max_cpu_minutes=budget))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    hours = [entry["cpu_hours"] for entry in resumed.state.log_history if "cpu_hours" in entry]
    assert hours == sorted(hours) and hours[0] == saved[-1] and 60 * hours[-1] >= budget - 1e-4
    assert resumed.state.global_step < resumed.state.max_steps


def test_resume_from_checkpoint_continues_the_same_run(chat_target, smollm2_tokenizer, responses, tmp_path):
    dataset = build_training_dataset(responses, max_length=128)
    straight = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path / "straight")
    straight.train()
    interrupted = make_trainer(
        chat_target, smollm2_tokenizer, dataset, tmp_path / "resumed", save_strategy="steps", save_steps=3
    )
    interrupted.train()
    resumed = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-3"))
    assert resumed.state.global_step == 6
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name, rtol=1e-4, atol=1e-5)


def test_example_script_trains_dfly_with_the_same_trainer(chat_target, smollm2_tokenizer, responses, tmp_path):
    """One trainer, one script: DFly (hybrid conditioning, AR head, LK loss, online hidden states) trains too."""
    train_main = example("train_drafter").main
    target_dir = tmp_path / "target"
    chat_target.save_pretrained(target_dir)
    smollm2_tokenizer.save_pretrained(target_dir)
    train_main(
        [
            "--config",
            os.path.join(REPO, "examples", "configs", "tiny_dfly.yaml"),
            "--target",
            str(target_dir),
            "--responses",
            responses,
            "--output_dir",
            str(tmp_path / "dfly"),
        ]
    )
    drafter = AutoModel.from_pretrained(tmp_path / "dfly")
    assert type(drafter).__name__ == "DFlyDrafter" and drafter.config.loss_type == "lk"
    assert drafter.config.mask_token_id == smollm2_tokenizer.unk_token_id
    assert drafter.ar_head.down_proj.weight.abs().sum() > 0, "the AR head was trained"
    drafter.bind_target(chat_target, smollm2_tokenizer)
    prompt = torch.tensor([encode_chat(smollm2_tokenizer, "Write a loop in Python.")])
    expected = chat_target.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(
        chat_target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=drafter), expected
    )


@pytest.mark.slow
def test_example_script_trains_with_two_cpu_processes(chat_target, smollm2_tokenizer, responses, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU really runs DDP with world size 2 (gloo)."""
    target_dir = tmp_path / "target"
    chat_target.save_pretrained(target_dir)
    smollm2_tokenizer.save_pretrained(target_dir)
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        os.path.join(REPO, "examples", "train_mtp.py"),
        "--config",
        os.path.join(REPO, "examples", "configs", "tiny_mtp.yaml"),
        "--target",
        str(target_dir),
        "--responses",
        responses,
        "--output_dir",
        str(tmp_path / "drafter"),
        "--hidden_cache_dir",
        str(tmp_path / "cache"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"world size 2\b", result.stdout), result.stdout[-2000:]
    drafter = AutoModel.from_pretrained(tmp_path / "drafter")
    assert isinstance(drafter, AngelSpecMTPDrafter) and drafter.config.draft_vocab_size == 256
    drafter.bind_target(chat_target, smollm2_tokenizer)


def test_draft_losses_follow_their_definitions():
    from angelspec_hf.training import distillation_kl, draft_loss

    student, teacher = torch.randn(7, 16), torch.randn(7, 16)
    p, q = teacher.softmax(-1), student.softmax(-1)
    overlap = torch.minimum(p, q).sum(-1)
    torch.testing.assert_close(draft_loss(student, teacher, "tv"), 1 - overlap)
    torch.testing.assert_close(draft_loss(student, teacher, "tv"), 0.5 * (p - q).abs().sum(-1))
    torch.testing.assert_close(draft_loss(student, teacher, "ce"), -q.log()[torch.arange(7), p.argmax(-1)])
    weight = torch.exp(-3.0 * overlap)
    expected = weight * distillation_kl(student, teacher) + (1 - weight) * (1 - overlap)
    torch.testing.assert_close(draft_loss(student, teacher, "lk", lk_eta=3.0), expected)


def test_top_k_distillation_is_the_full_kl_when_k_covers_the_vocabulary():
    from angelspec_hf.training import distillation_kl

    student, teacher = torch.randn(5, 32), torch.randn(5, 32)
    full = distillation_kl(student, teacher)
    torch.testing.assert_close(distillation_kl(student, teacher, top_k=32), full)
    assert (full >= 0).all() and torch.allclose(distillation_kl(teacher, teacher), torch.zeros(5), atol=1e-6)
    assert torch.isfinite(distillation_kl(student, teacher, top_k=4)).all()


def test_every_recipe_ladder_rung_is_a_valid_training_command():
    RUNGS = example("recipe_ladder").RUNGS
    parse_arguments = example("train_drafter").parse_arguments
    for kind, rungs in RUNGS.items():
        config = os.path.join(REPO, "examples", "configs", f"smollm2_{kind}_ladder.yaml")
        for name, overrides in rungs.items():
            drafter_args, data_args, training_args = parse_arguments(
                ["--config", config, *overrides, "--output_dir", "x"]
            )
            assert drafter_args.drafter_type == kind and data_args.max_cpu_minutes == 20, name
            assert training_args.eval_strategy == "steps" and data_args.eval_responses, name


def test_yaml_config_keeps_null_and_lists_and_refuses_unknown_keys(tmp_path):
    parse_arguments = example("train_drafter").parse_arguments
    config = tmp_path / "run.yaml"
    config.write_text(
        "drafter_type: mtp\ninit_from: null\nmax_cpu_minutes: null\ntarget_layer_ids: [1, 14]\n"
        "responses: r.jsonl.gz\noutput_dir: runs/x\nlearning_rate: 0.0003\n"
    )
    drafter_args, data_args, training_args = parse_arguments(["--config", str(config), "--learning_rate", "0.001"])
    assert drafter_args.init_from is None and data_args.max_cpu_minutes is None
    assert drafter_args.target_layer_ids == [1, 14] and training_args.learning_rate == 0.001  # the command line wins
    config.write_text("drafter_type: mtp\nresponses: r.jsonl.gz\noutput_dir: runs/x\nlearning_rat: 0.1\n")
    with pytest.raises(ValueError, match="learning_rat"):
        parse_arguments(["--config", str(config)])


def test_mtp_starting_points_are_checked_when_the_command_is_parsed(tmp_path):
    parse_arguments = example("train_drafter").parse_arguments
    config = tmp_path / "run.yaml"
    config.write_text("responses: r.jsonl.gz\noutput_dir: runs/x\n")
    drafter_args, _, _ = parse_arguments(["--config", str(config), "--native_mtp", "true"])
    assert drafter_args.native_mtp and drafter_args.input_layout is None
    for overrides, message in (
        (["--drafter_type", "dfly", "--native_mtp", "true"], "MTP options"),
        (["--drafter_type", "dfly", "--input_layout", "eagle3"], "MTP options"),
        (["--native_mtp", "true", "--warm_start", "true"], "starting point"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_arguments(["--config", str(config), *overrides])


@pytest.mark.parametrize(
    "name",
    ["mtp_long", "mtp_long_taps", "dfly_long", "dflash_long", "mtp_taps_cooldown", "dfly_cooldown", "mtp_eagle3"],
)
def test_long_run_configs_parse_with_checkpoints_inside_fifteen_minutes(name):
    from angelspec_hf.hub import resolve_drafter

    parse_arguments = example("train_drafter").parse_arguments
    drafter_args, data_args, training_args = parse_arguments(
        ["--config", os.path.join(REPO, "examples", "configs", f"smollm2_{name}.yaml")]
    )
    # a run that continues a shipped drafter names one that exists
    start = drafter_args.init_from and os.path.join(REPO, resolve_drafter(drafter_args.init_from))
    assert start is None or os.path.isfile(os.path.join(start, "config.json"))
    assert data_args.eval_responses and training_args.eval_strategy == "steps"
    # one step takes at most ~8 s on one thread at this max_length: a checkpoint every save_steps stays under 15 min
    assert training_args.save_strategy == "steps" and training_args.save_steps * 8 <= 15 * 60


@pytest.mark.parametrize("name", ["mtp_chat_more", "dfly_more", "dfly_more_cooldown", "dflash_more"])
def test_the_configs_that_trained_in_bf16_measure_it_rather_than_assume_it(name):
    """The runs trained under bf16 on an AMX Xeon; their configs use it where the machine measures it faster."""
    parse_arguments = example("train_drafter").parse_arguments
    drafter_args, data_args, training_args = parse_arguments(
        ["--config", os.path.join(REPO, "examples", "configs", f"smollm2_{name}.yaml")]
    )
    assert drafter_args.bf16_where_faster and data_args.eval_responses
    assert not training_args.bf16 and data_args.hidden_compute_dtype == "float32"  # until measured


def test_training_curve_reads_the_newest_state_and_plots(tmp_path):
    from angelspec_hf.cli import main as cli_main
    from angelspec_hf.training.curves import training_curve

    def write_state(folder, history):
        os.makedirs(folder, exist_ok=True)
        with open(folder / "trainer_state.json", "w") as handle:
            json.dump({"global_step": history[-1]["step"], "log_history": history}, handle)

    older = [{"loss": 2.0, "step": 10, "cpu_hours": 0.1, "num_input_tokens_seen": 1000}, {"eval_tau": 1.2, "step": 10}]
    newer = older + [
        {"loss": 1.5, "step": 20, "cpu_hours": 0.2, "num_input_tokens_seen": 2000},
        {"eval_tau": 1.4, "step": 20},
    ]
    write_state(tmp_path / "run", older)  # the output folder of a first part; its checkpoint is further on
    write_state(tmp_path / "run" / "checkpoint-20", newer)
    points = training_curve(str(tmp_path / "run"))
    assert [(p.step, p.cpu_hours, p.tokens, p.tau) for p in points] == [(10, 0.1, 1000, 1.2), (20, 0.2, 2000, 1.4)]

    cli_main(["curve", str(tmp_path / "run"), "--labels", "mtp", "--output", str(tmp_path / "curve.png")])
    assert os.path.getsize(tmp_path / "curve.png") > 0
    with pytest.raises(SystemExit):
        cli_main(["curve", str(tmp_path / "missing")])


def test_a_curves_log_trend_says_what_compute_a_target_needs(tmp_path, capsys):
    """τ = 1 + 0.1 ln(CPU-hours) after a fast warm-up: the fit over the later half recovers the trend and the
    CPU-hours at which it reaches τ 1.5 (e^5); a flat curve never does. A copied trainer state reads as a run."""
    import math

    from angelspec_hf.cli import main as cli_main
    from angelspec_hf.training.curves import CurvePoint, fit_log_trend, training_curve

    hours = [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0]
    warm_up = {0.05: 0.3, 0.1: 0.2}  # far below the trend: a fit over every point would be steeper
    rising = [CurvePoint(i, h, int(h * 1e6), 1 + 0.1 * math.log(h) - warm_up.get(h, 0.0)) for i, h in enumerate(hours)]
    trend = fit_log_trend(rising)
    assert trend.fitted == 4 and trend.slope == pytest.approx(0.1) and trend.intercept == pytest.approx(1.0)
    assert trend.reaches(1.5) == pytest.approx(math.exp(5))
    assert fit_log_trend(rising, "tokens").reaches(1.5) == pytest.approx(math.exp(5) * 1e6)
    flat = [CurvePoint(i, h, None, 1.3 - 0.01 * i) for i, h in enumerate(hours)]
    assert fit_log_trend(flat).reaches(1.5) is None and fit_log_trend(flat, "tokens") is None
    assert fit_log_trend(rising[:2]) is None

    history = [
        entry
        for p in rising
        for entry in ({"step": p.step, "cpu_hours": p.cpu_hours}, {"step": p.step, "eval_tau": p.tau})
    ]
    path = tmp_path / "mtp.trainer_state.json"
    path.write_text(json.dumps({"global_step": 7, "log_history": history}))
    assert [p.tau for p in training_curve(str(path))] == [p.tau for p in rising]
    cli_main(["curve", str(path), "--labels", "mtp", "--target-tau", "1.5"])
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| mtp |") and f"{math.exp(5):.3g}" in row and row.endswith("| – |")  # no tokens logged


def test_sigterm_stops_training_at_the_step_with_a_checkpoint(chat_target, smollm2_tokenizer, responses, tmp_path):
    import signal

    from transformers import TrainerCallback

    from angelspec_hf.training import GracefulStopCallback

    class TerminateAtStepTwo(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:  # step 2 is under way when the signal comes
                os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    dataset = build_training_dataset(responses, max_length=128)
    trainer = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path, save_strategy="steps", save_steps=100)
    trainer.add_callback(GracefulStopCallback())
    trainer.add_callback(TerminateAtStepTwo())
    trainer.train()
    assert trainer.state.global_step == 2 and os.path.isdir(tmp_path / "checkpoint-2")
    assert signal.getsignal(signal.SIGTERM) == handler


def test_a_run_snapshotted_to_a_card_continues_on_a_new_machine(
    chat_target, smollm2_tokenizer, responses, tmp_path, capsys
):
    """`angelspec snapshot` writes a run's best checkpoint as a float16 card with the run's history; when the run's
    checkpoints are gone, `continue_from` that card goes on with its steps, CPU-hours and tokens, in float32."""
    from angelspec_hf.cli import main as cli_main

    train_main = example("train_drafter").main
    target_dir = tmp_path / "target"
    chat_target.save_pretrained(target_dir)
    smollm2_tokenizer.save_pretrained(target_dir)
    common = [
        "--config",
        os.path.join(REPO, "examples", "configs", "tiny_mtp.yaml"),
        "--target",
        str(target_dir),
        "--responses",
        responses,
        "--eval_responses",
        responses,
        "--eval_prompts",
        "0",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--include_num_input_tokens_seen",
        "true",
    ]
    first, second, card = tmp_path / "first", tmp_path / "second", tmp_path / "card"
    train_main([*common, "--output_dir", str(first)])
    stopped = json.loads((first / "checkpoint-4" / "trainer_state.json").read_text())
    shutil.copytree(first / "checkpoint-4", first / "checkpoint-5")  # saved by a stop, between evaluations
    (first / "checkpoint-5" / "trainer_state.json").write_text(json.dumps({**stopped, "global_step": 5}))
    card.mkdir()
    (card / "README.md").write_text("the card's own text\n")
    cli_main(["snapshot", str(first), "--output", str(card)])
    written = json.loads((card / "trainer_state.json").read_text())
    taus = {entry["step"]: entry["eval_tau"] for entry in written["log_history"] if "eval_tau" in entry}
    assert written["global_step"] == max(taus, key=lambda step: (taus[step], step))  # the best checkpoint
    assert (card / "README.md").read_text() == "the card's own text\n"
    assert AutoModel.from_pretrained(card).dtype == torch.float16
    assert AutoTokenizer.from_pretrained(card).get_vocab() == smollm2_tokenizer.get_vocab()  # a card as every card is
    cli_main(["snapshot", str(first), "--output", str(card)])  # nothing better: the card stays
    assert "keeps its drafter" in capsys.readouterr().out

    train_main([*common, "--output_dir", str(second), "--continue_from", str(card), "--max_steps", "6"])
    state = json.loads((second / "trainer_state.json").read_text())
    history = state["log_history"]
    continued = [index for index, entry in enumerate(history) if entry.get("continued_from") == str(card)]
    assert state["global_step"] == 6 and len(continued) == 1
    before, after = history[: continued[0]], history[continued[0] + 1 :]
    assert before == written["log_history"]  # the card's curve, then this part's
    hours = [entry["cpu_hours"] for entry in history if "cpu_hours" in entry]
    assert hours == sorted(hours) and any("cpu_hours" in entry for entry in after)
    tokens_before = written["num_input_tokens_seen"]
    assert tokens_before > 0 and state["num_input_tokens_seen"] > tokens_before
    assert [entry["step"] for entry in after if "eval_tau" in entry] == list(range(written["global_step"] + 2, 7, 2))
    assert AutoModel.from_pretrained(second).dtype == torch.float32  # trained in float32, not the card's float16

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as refused:
        cli_main(["snapshot", str(first), "--output", str(plain)])
    assert refused.value.code == 2 and "no recorded run" in capsys.readouterr().err


def test_bf16_speedups_are_measured_on_the_targets_own_computations(chat_target):
    """`Bf16Choice.measure` times the target's prefill and a draft layer's step of the target's family, each in
    float32 and under bf16 autocast; bf16 is chosen for each part only where it is at least `MIN_SPEEDUP` faster."""
    choice = Bf16Choice.measure(chat_target, rows=1, length=16, repeats=1)
    assert 0 < choice.states_speedup < float("inf") and 0 < choice.step_speedup < float("inf")
    assert f"{choice.states_speedup:.2f}x on the target's prefill" in choice.describe()
    only_states = Bf16Choice(states_speedup=MIN_SPEEDUP, step_speedup=MIN_SPEEDUP - 0.01)
    assert only_states.arguments() == ["--hidden_compute_dtype", "bfloat16", "--bf16", "false"]
    assert Bf16Choice(0.6, 1.8).arguments() == ["--hidden_compute_dtype", "float32", "--bf16", "true"]


def test_a_run_with_bf16_where_faster_trains_as_it_measured(
    chat_target, smollm2_tokenizer, responses, tmp_path, monkeypatch, capsys
):
    """`bf16_where_faster`: the run measures, says what it chose, and caches its states and trains its steps so —
    each part on its own (a machine where only the prefill pays, and its opposite); set beside `bf16` it is refused
    before the target loads."""
    module = example("train_drafter")
    seen = []

    class Recording(module.AngelSpecTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.accelerator.mixed_precision)

    monkeypatch.setattr(module, "AngelSpecTrainer", Recording)
    precompute = module.precompute_hidden_states

    def recording_precompute(*args, compute_dtype="float32", **kwargs):
        seen.append(compute_dtype)
        return precompute(*args, compute_dtype=compute_dtype, **kwargs)

    monkeypatch.setattr(module, "precompute_hidden_states", recording_precompute)
    target_dir = tmp_path / "target"
    chat_target.save_pretrained(target_dir)
    smollm2_tokenizer.save_pretrained(target_dir)
    common = ["--config", os.path.join(REPO, "examples", "configs", "tiny_mtp.yaml"), "--target", str(target_dir)]
    common += ["--responses", responses, "--eval_prompts", "0", "--max_steps", "1", "--bf16_where_faster", "true"]
    for choice, expected in ((Bf16Choice(2.0, 0.6), ["bfloat16", "no"]), (Bf16Choice(0.7, 1.5), ["float32", "bf16"])):
        monkeypatch.setattr(module.Bf16Choice, "measure", classmethod(lambda cls, target, choice=choice: choice))
        seen.clear()
        module.main([*common, "--output_dir", str(tmp_path / str(choice.step))])
        assert seen == expected
        assert choice.describe() in capsys.readouterr().out
    with pytest.raises(ValueError, match="leave both unset"):
        module.main([*common, "--bf16", "true", "--output_dir", str(tmp_path / "refused")])
