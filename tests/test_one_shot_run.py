"""`examples/train_all.py`, the one-shot run for a lent GPU, end to end on the CPU with a tiny target: fresh data in
both domains, MTP, DFly and DFlash trained, scored offline and saved as fp16 cards, each phase on its deadline."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from test_training import REPO, example

from angelspec_hf import load_drafter
from angelspec_hf.prompts import encode_chat
from angelspec_hf.training.regenerate import read_responses, regenerate_responses


CONFIGS = os.path.join(REPO, "examples", "configs")


def train_all():
    return example("train_all")


@pytest.fixture
def target_dir(chat_target, smollm2_tokenizer, tmp_path):
    directory = tmp_path / "target"
    chat_target.save_pretrained(directory)
    smollm2_tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.slow
def test_the_one_shot_run_makes_data_trains_scores_and_saves_every_recipe(
    chat_target, smollm2_tokenizer, target_dir, tmp_path
):
    heldout = str(tmp_path / "heldout.jsonl.gz")
    regenerate_responses(
        chat_target, smollm2_tokenizer, ["mt_bench", "gsm8k_test"], heldout, limit_per_source=2, max_new_tokens=16
    )
    output = tmp_path / "run"
    # 10 minutes, of which 5 s make data: a greedy pass over one prompt per set (a fraction of a second), then sampled
    # passes; the recipes then stop at their 3 steps, long before their wall-clock budget
    argv = ["--target", target_dir, "--device", "cpu", "--minutes", "10", "--regenerate-share", "0.008"]
    argv += ["--output", str(output), "--batch-size", "4", "--max-new-tokens", "12", "--limit-per-source", "1"]
    argv += ["--heldout", heldout, "--train-args", "--max_steps 3"]
    for name in ("mtp", "dfly", "dflash"):
        argv += ["--recipe", f"{name}={os.path.join(CONFIGS, f'tiny_{name}.yaml')}"]
    summary = train_all().main(argv)

    assert json.loads((output / "summary.json").read_text()) == summary
    for domain, sources in (("chat", {"alpaca_eval", "self_instruct"}), ("code", {"gsm8k_train", "mbpp_train"})):
        records = read_responses(str(output / "data" / f"{domain}.jsonl.gz"))
        assert sources <= {record["source"] for record in records}
        assert any("seed" in record for record in records), "sampled passes follow the greedy one until the deadline"
        assert summary["phases"][f"regenerate_{domain}"]["tokens"] == sum(len(r["response_ids"]) for r in records)
        first = next(record for record in records if "seed" not in record)
        expected = chat_target.generate(torch.tensor([first["prompt_ids"]]), max_new_tokens=12, do_sample=False)
        assert expected[0, len(first["prompt_ids"]) :].tolist() == first["response_ids"], "the target's own answer"
    for name in ("mtp", "dfly", "dflash"):
        phase = summary["phases"][name]
        assert phase["steps"] == 3 and phase["offline_tau"] >= 1.0
        card = output / "cards" / name
        with safe_open(str(card / "model.safetensors"), "pt") as weights:
            dtypes = {weights.get_tensor(key).dtype for key in weights.keys()}
        assert {dtype for dtype in dtypes if dtype.is_floating_point} == {torch.float16}  # (vocabulary maps: int64)
        assert f"Offline τ {phase['offline_tau']:.3f}" in (card / "README.md").read_text()
        drafter = load_drafter(str(card), chat_target, smollm2_tokenizer).float()
        assert drafter.config.drafter_kind == name
        prompt = torch.tensor([encode_chat(smollm2_tokenizer, "Add 2 and 3.")])
        plain = chat_target.generate(prompt, max_new_tokens=8, do_sample=False)
        assert torch.equal(
            chat_target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter), plain
        )
    dflash = json.loads((output / "cards" / "dflash" / "config.json").read_text())
    assert not dflash["per_layer_context_mix"] and not dflash["ar_head"]


def test_the_one_shot_run_names_a_missing_prompt_set_before_loading(target_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ANGELSPEC_DATA_DIR")
    with pytest.raises(SystemExit) as exit_info:
        train_all().main(["--target", target_dir, "--output", str(tmp_path / "run"), "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "'alpaca_eval' is not shipped with the package" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "refused before anything was made"
