"""Training faults: a run killed while saving a checkpoint, and stale or damaged hidden-state caches."""

import copy
import glob
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch
from conftest import errors_of_concurrent_calls, make_target
from test_training import REPO, make_trainer

from angelspec_hf.training import AngelSpecTrainer, build_training_dataset, precompute_hidden_states
from angelspec_hf.training.data import target_hidden_states


@pytest.fixture(scope="module")
def responses(tmp_path_factory):
    """A responses file of random conversations: training needs tokens, not the target's real answers."""
    path = str(tmp_path_factory.mktemp("data") / "responses.jsonl.gz")
    generator = torch.Generator().manual_seed(0)
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for i in range(12):
            prompt_ids, response_ids = torch.randint(3, 4000, (2, 24), generator=generator).tolist()
            record = {
                "source": "random",
                "prompt": f"prompt {i}",
                "prompt_ids": prompt_ids,
                "response_ids": response_ids,
            }
            handle.write(json.dumps(record) + "\n")
    return path


KILLED_WHILE_SAVING = """
import os, signal, sys
from angelspec_hf.training import AngelSpecTrainer
from train_drafter import main

save_rng_state = AngelSpecTrainer._save_rng_state

def killed_while_saving(self, output_dir):
    # The weights and optimizer of this checkpoint are written, its RNG and trainer states are not.
    if self.state.global_step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    save_rng_state(self, output_dir)

AngelSpecTrainer._save_rng_state = killed_while_saving
main(sys.argv[1:])
"""


def test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint(
    chat_target,
    smollm2_tokenizer,
    responses,
    tmp_path,
    monkeypatch,  # noqa: F811
    package_log,
):
    target_dir, output_dir = tmp_path / "target", tmp_path / "drafter"
    chat_target.save_pretrained(target_dir)
    smollm2_tokenizer.save_pretrained(target_dir)
    arguments = [
        "--config",
        os.path.join(REPO, "examples", "configs", "tiny_mtp.yaml"),
        "--target",
        str(target_dir),
        "--responses",
        responses,
        "--output_dir",
        str(output_dir),
        "--hidden_cache_dir",
        str(tmp_path / "cache"),
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--eval_prompts",
        "0",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(REPO, "examples")}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_SAVING, *arguments], capture_output=True, text=True, env=env, timeout=300
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert {"checkpoint-2", "tmp-checkpoint-4"} <= set(os.listdir(output_dir))
    assert "checkpoint-4" not in os.listdir(output_dir), "a checkpoint is visible only once complete"

    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        from train_drafter import main as train_main
    finally:
        sys.path.pop(0)
    resumed_from = []
    train = AngelSpecTrainer.train

    def recording_train(self, resume_from_checkpoint=None, *args, **kwargs):
        resumed_from.append(resume_from_checkpoint)
        return train(self, resume_from_checkpoint, *args, **kwargs)

    monkeypatch.setattr(AngelSpecTrainer, "train", recording_train)
    with package_log.warns("tmp-checkpoint-4, the remains of a save") as emitted:
        train_main(arguments)
    assert not [message for message in emitted if "Hidden-state cache" in message]
    assert len(glob.glob(str(tmp_path / "cache" / "hidden-*.arrow"))) == 1, "the killed run's cache is reused"
    assert resumed_from == [str(output_dir / "checkpoint-2")]
    with open(output_dir / "trainer_state.json") as handle:
        assert json.load(handle)["global_step"] == 4
    assert os.path.isfile(output_dir / "checkpoint-4" / "trainer_state.json")
    assert "tmp-checkpoint-4" not in os.listdir(output_dir)


def test_resume_skips_an_incomplete_checkpoint_with_a_warning(
    chat_target,
    smollm2_tokenizer,
    responses,
    tmp_path,  # noqa: F811
    package_log,
):
    dataset = build_training_dataset(responses, max_length=128)
    first = make_trainer(
        chat_target, smollm2_tokenizer, dataset, tmp_path, max_steps=4, save_strategy="steps", save_steps=2
    )
    first.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    os.remove(tmp_path / "checkpoint-4" / "trainer_state.json")  # as a save killed in place leaves it
    resumed = make_trainer(chat_target, smollm2_tokenizer, dataset, tmp_path, max_steps=4)
    with package_log.warns("incomplete checkpoint .*checkpoint-4"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert os.path.isdir(tmp_path / "checkpoint-4"), "the incomplete checkpoint is left for the user"


@pytest.fixture(scope="module")
def tiny_target():
    return make_target("llama", dtype=torch.float32, seed=5)


def packed_rows(num_rows: int = 6, length: int = 24) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (num_rows, length), generator=generator).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "position_ids": [list(range(length))] * num_rows})


def assert_hidden_states_of(target, cached, dataset, indices):
    for row, expected in zip(cached, dataset):
        states = target_hidden_states(
            target, torch.tensor([expected["input_ids"]]), torch.tensor([expected["position_ids"]]), indices
        )
        expected_hidden = torch.stack([s[0] for s in states], dim=1)
        torch.testing.assert_close(row["target_hidden"].float(), expected_hidden, rtol=1e-3, atol=1e-3)


def reopen_without_warnings(package_log, target, dataset, indices, cache_dir, dtype):
    """A recomputed cache is valid: the next run reuses it as it is, without a warning."""
    (cache_file,) = glob.glob(os.path.join(cache_dir, "*.arrow"))
    written = os.stat(cache_file).st_mtime_ns
    with package_log.silent():
        cached = precompute_hidden_states(dataset, target, indices, cache_dir, dtype=dtype)
    assert os.stat(cache_file).st_mtime_ns == written
    return cached


def test_a_truncated_hidden_state_cache_is_recomputed_with_a_warning(tiny_target, tmp_path, package_log):
    dataset, indices, cache_dir = packed_rows(), [1, 2], str(tmp_path)
    precompute_hidden_states(dataset, tiny_target, indices, cache_dir)
    (cache_file,) = glob.glob(os.path.join(cache_dir, "*.arrow"))
    with open(cache_file, "r+b") as handle:
        handle.truncate(os.path.getsize(cache_file) // 2)
    with package_log.warns(r"hidden-\w+\.arrow is truncated"):
        cached = precompute_hidden_states(dataset, tiny_target, indices, cache_dir)
    assert len(cached) == len(dataset)
    assert_hidden_states_of(tiny_target, cached, dataset, indices)
    reopen_without_warnings(package_log, tiny_target, dataset, indices, cache_dir, "float16")


@pytest.mark.parametrize("dtype, value", [("float32", 1e30), ("float16", float("nan")), ("float16", float("inf"))])
def test_corrupted_hidden_state_values_are_recomputed_with_a_warning(tiny_target, tmp_path, dtype, value, package_log):
    dataset, indices, cache_dir = packed_rows(), [2], str(tmp_path)
    cached = precompute_hidden_states(dataset, tiny_target, indices, cache_dir, dtype=dtype)
    (cache_file,) = glob.glob(os.path.join(cache_dir, "*.arrow"))
    original = cached[3]["target_hidden"][5, 0, :8].to(getattr(torch, dtype)).numpy().tobytes()  # unique in the file
    del cached
    with open(cache_file, "r+b") as handle:  # overwritten in place: same size, only the values check can tell
        content = handle.read()
        assert content.count(original) == 1
        handle.seek(content.index(original))
        handle.write(np.full(8, value, dtype=dtype).tobytes())
    with package_log.warns(r"hidden-\w+\.arrow is damaged: .*not finite or beyond"):
        cached = precompute_hidden_states(dataset, tiny_target, indices, cache_dir, dtype=dtype)
    assert_hidden_states_of(tiny_target, cached, dataset, indices)
    reopen_without_warnings(package_log, tiny_target, dataset, indices, cache_dir, dtype)


def test_a_target_whose_weights_changed_at_the_same_path_gets_its_cache_recomputed(tiny_target, tmp_path, package_log):
    dataset, indices, cache_dir = packed_rows(), [1, 2], str(tmp_path)
    precompute_hidden_states(dataset, tiny_target, indices, cache_dir)
    retrained = copy.deepcopy(tiny_target)  # same name_or_path, other weights
    retrained.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    assert retrained.config.name_or_path == tiny_target.config.name_or_path
    with package_log.warns(r"hidden-\w+\.arrow is stale: computed with a different target_sha256"):
        cached = precompute_hidden_states(dataset, retrained, indices, cache_dir)
    assert_hidden_states_of(retrained, cached, dataset, indices)
    assert len(glob.glob(os.path.join(cache_dir, "*.arrow"))) == 1, "the stale cache was replaced, not kept beside"
    reopen_without_warnings(package_log, retrained, dataset, indices, cache_dir, "float16")


KILLED_WHILE_CACHING = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch
from test_training_faults import packed_rows
from conftest import make_target
from angelspec_hf.training import data

target = make_target("llama", dtype=torch.float32, seed=5)
forward = data.target_hidden_states
calls = []

def killed_in_the_third_shard(*args, **kwargs):
    calls.append(1)
    if len(calls) == 5:  # shards of 2 rows: the first two are complete, the third has one row done
        os.kill(os.getpid(), signal.SIGKILL)
    return forward(*args, **kwargs)

data.target_hidden_states = killed_in_the_third_shard
data.precompute_hidden_states(packed_rows(), target, [1, 2], {cache_dir!r}, shard_rows=2)
"""


def test_a_precomputation_killed_midway_resumes_at_the_shard_it_was_writing(tiny_target, tmp_path):
    dataset, indices, cache_dir = packed_rows(), [1, 2], str(tmp_path)
    script = KILLED_WHILE_CACHING.format(tests=os.path.dirname(os.path.abspath(__file__)), cache_dir=cache_dir)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    complete = sorted(glob.glob(os.path.join(cache_dir, "*.json")))
    assert len(complete) == 2, "two shards were complete when the run was killed"
    written = {path: os.stat(path).st_mtime_ns for path in complete}
    calls = []
    forward = target_hidden_states

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("angelspec_hf.training.data.target_hidden_states", counted)
        cached = precompute_hidden_states(dataset, tiny_target, indices, cache_dir, shard_rows=2)
    assert len(calls) == 2, "only the third shard's rows were computed again"
    assert {path: os.stat(path).st_mtime_ns for path in complete} == written
    assert len(cached) == len(dataset)
    assert_hidden_states_of(tiny_target, cached, dataset, indices)


def test_saves_into_one_folder_take_turns_and_clear_what_killed_saves_left(tmp_path):
    """Two threads save different drafters into one folder 15 times each: every save completes, the folder holds one
    whole checkpoint, no staging or swapped-out folder is left. Folders a killed save left (`.<name>.saving-*`
    beside it, `.<name>.old-*` inside it) are removed by the next save."""
    from transformers import AutoModel

    from angelspec_hf import SuffixDrafter

    target = make_target("llama", num_hidden_layers=2)
    drafters = [SuffixDrafter.from_target(target, num_draft_tokens=k) for k in (3, 5)]
    folder = tmp_path / "out"

    def save_many(drafter):
        for _ in range(15):
            drafter.save_pretrained(folder)

    assert errors_of_concurrent_calls(save_many, drafters) == []
    assert AutoModel.from_pretrained(folder).config.num_draft_tokens in (3, 5)
    assert os.listdir(tmp_path) == ["out"]
    assert not [entry for entry in os.listdir(folder) if ".old-" in entry]

    (tmp_path / ".out.saving-killed").mkdir()  # what a save killed mid-way leaves
    (tmp_path / ".tmp-checkpoint-3.saving-killed").mkdir()
    (folder / ".custom_generate.old-killed").mkdir()
    drafters[0].save_pretrained(folder)
    assert os.listdir(tmp_path) == ["out"]
    assert not [entry for entry in os.listdir(folder) if ".old-" in entry]


def test_a_run_stopped_in_its_final_save_finishes_it_without_training_past_max_steps(
    chat_target, smollm2_tokenizer, responses, tmp_path, monkeypatch
):
    """All max_steps trained and checkpointed, then killed in the final save (the output folder holds only its
    checkpoints): the rerun finishes that save from the last checkpoint and trains no step more (it ran one past)."""
    from safetensors.torch import load_file

    target_dir, output_dir = tmp_path / "target", tmp_path / "drafter"
    chat_target.save_pretrained(target_dir)
    smollm2_tokenizer.save_pretrained(target_dir)
    arguments = ["--config", os.path.join(REPO, "examples", "configs", "tiny_mtp.yaml"), "--target", str(target_dir)]
    arguments += ["--responses", responses, "--output_dir", str(output_dir), "--hidden_cache_dir", str(tmp_path / "c")]
    arguments += ["--save_strategy", "steps", "--save_steps", "2", "--eval_prompts", "0"]  # tiny_mtp: max_steps 4
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        from train_drafter import main as train_main
    finally:
        sys.path.pop(0)
    train_main(arguments)
    trained = load_file(output_dir / "model.safetensors")
    for name in os.listdir(output_dir):
        if not name.startswith("checkpoint-"):
            path = output_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    steps = []
    monkeypatch.setattr(AngelSpecTrainer, "training_step", lambda self, *a, **k: steps.append(1) or torch.tensor(0.0))
    train_main(arguments)
    assert steps == [], "no step trained past max_steps"
    with open(output_dir / "trainer_state.json") as handle:
        assert json.load(handle)["global_step"] == 4
    finished = load_file(output_dir / "model.safetensors")
    assert trained.keys() == finished.keys()
    for name in trained:
        torch.testing.assert_close(finished[name], trained[name], msg=name)
