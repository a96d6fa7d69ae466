"""Drafters as a Hugging Face user meets them: in `pipeline()` (by object or path, one prompt or a batch), loading
targets by dtype name, progress bars, and pushed to a Hub (a local stand-in for its API) with code and a real card."""

import json
import os
import shutil
import types

import pytest
import torch
from conftest import make_target
from transformers import pipeline

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter


PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def text_target(smollm2_tokenizer):
    return make_target("llama", vocab_size=len(smollm2_tokenizer), dtype=torch.float32, seed=3, bos_token_id=1)


@pytest.mark.parametrize("family", ["mtp", "dfly"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_text_generation_pipeline_takes_a_drafter_as_assistant_model(
    text_target, smollm2_tokenizer, family, batch_size
):
    torch.manual_seed(0)
    if family == "mtp":
        drafter = AngelSpecMTPDrafter.from_target(text_target, num_depths=2)
    else:
        drafter = DFlyDrafter.from_target(text_target, block_size=4, num_draft_layers=1, mask_token_id=5)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # what the pipeline compares with the target's
        assert getattr(drafter.config, key) == getattr(text_target.config, key)
    options = dict(max_new_tokens=12, do_sample=False, batch_size=batch_size, return_full_text=False)
    smollm2_tokenizer.padding_side = "left"
    plain = pipeline("text-generation", model=text_target, tokenizer=smollm2_tokenizer)(PROMPTS, **options)
    assisted = pipeline("text-generation", model=text_target, tokenizer=smollm2_tokenizer, assistant_model=drafter)
    assert assisted.assistant_model is drafter and assisted.assistant_tokenizer is None  # one tokenizer: shared
    assert assisted(PROMPTS, **options) == plain


def test_text_generation_pipeline_loads_a_drafter_by_path(text_target, smollm2_tokenizer, tmp_path):
    """A drafter saved after binding keeps the target's tokenizer beside it: the pipeline loads both from the folder
    and, the vocabularies being one, drafts with the target's tokenizer."""
    torch.manual_seed(0)
    drafter = AngelSpecMTPDrafter.from_target(text_target, num_depths=2).bind_target(text_target, smollm2_tokenizer)
    drafter.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer_config.json").is_file()
    options = dict(max_new_tokens=12, do_sample=False, return_full_text=False)
    plain = pipeline("text-generation", model=text_target, tokenizer=smollm2_tokenizer)(PROMPTS[:2], **options)
    assisted = pipeline(
        "text-generation", model=text_target, tokenizer=smollm2_tokenizer, assistant_model=str(tmp_path)
    )
    assert type(assisted.assistant_model) is AngelSpecMTPDrafter and assisted.assistant_tokenizer is None
    assert assisted(PROMPTS[:2], **options) == plain


def test_load_target_takes_a_dtype_by_name(text_target, smollm2_tokenizer, tmp_path):
    from angelspec_hf import load_target

    text_target.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    assert load_target(str(tmp_path), dtype="bfloat16", device="cpu").model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be a torch dtype"):
        load_target(str(tmp_path), dtype="float33")


def test_progress_bars_follow_transformers_switch(text_target, capfd):
    from transformers.utils import logging

    from angelspec_hf import Request, SpeculativeEngine

    requests = [Request([1, 5, 9], max_new_tokens=4)]
    logging.disable_progress_bar()
    try:
        SpeculativeEngine(text_target, None, max_batch_size=1).generate(requests, progress=True)
        assert "engine" not in capfd.readouterr().err
    finally:
        logging.enable_progress_bar()
    SpeculativeEngine(text_target, None, max_batch_size=1).generate(requests, progress=True)
    assert "engine" in capfd.readouterr().err


class LocalHub:
    """A stand-in for `huggingface_hub.HfApi` that keeps repositories in a folder (offline)."""

    root = None

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=None, exist_ok=False):
        os.makedirs(os.path.join(self.root, repo_id), exist_ok=exist_ok)
        return types.SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, commit_message=None, revision=None, create_pr=False):
        shutil.copytree(folder_path, os.path.join(self.root, repo_id), dirs_exist_ok=True)
        return types.SimpleNamespace(commit_message=commit_message)


@pytest.fixture
def local_hub(tmp_path, monkeypatch):
    from angelspec_hf import hub

    monkeypatch.setattr(LocalHub, "root", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HfApi", LocalHub)
    return tmp_path / "hub"


def test_push_to_hub_uploads_weights_code_generation_config_and_a_real_card(text_target, local_hub):
    from huggingface_hub import ModelCard
    from transformers import AutoModel

    from angelspec_hf.hub import drafter_card

    drafter = AngelSpecMTPDrafter.from_target(text_target, num_depths=2)
    drafter.generation_config.update(num_assistant_tokens=2, num_assistant_tokens_schedule="constant")
    report = {"prompts": "mt_bench", "methods": [{"name": "mtp:me/tiny-mtp[dcut]", "tau": 1.8, "speedup": 1.25}]}
    card = drafter_card(drafter, "me/tiny-mtp", reports=[report], datasets=["mt_bench"], license="apache-2.0")
    drafter.push_to_hub("me/tiny-mtp", card=card, commit_message="first")
    repo = local_hub / "me" / "tiny-mtp"
    names = {path.name for path in repo.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "modeling_mtp.py", "README.md"} <= names
    assert "AutoModel" in json.loads((repo / "config.json").read_text())["auto_map"]
    data = ModelCard.load(repo / "README.md").data
    assert data.base_model == text_target.config.name_or_path and data.library_name == "transformers"
    assert data.pipeline_tag == "text-generation" and "mtp" in data.tags and data.license == "apache-2.0"
    assert [(r.metric_type, r.metric_value) for r in data.eval_results] == [("tau", 1.8), ("speedup", 1.25)]
    loaded = AutoModel.from_pretrained(repo)
    assert loaded.generation_config.num_assistant_tokens == 2
    assert loaded.generation_config.num_assistant_tokens_schedule == "constant"


def test_save_pretrained_with_push_to_hub_uploads_the_saved_folder_to_its_name(text_target, local_hub, tmp_path):
    drafter = AngelSpecMTPDrafter.from_target(text_target, num_depths=2)
    drafter.save_pretrained(tmp_path / "my-drafter", push_to_hub=True)
    repo = local_hub / "my-drafter"  # named after the folder, not the staging folder the save wrote first
    saved = [p.name for p in (tmp_path / "my-drafter").iterdir()]
    assert sorted(p.name for p in repo.iterdir()) == sorted(saved + ["README.md"])
    assert "modeling_mtp.py" in os.listdir(repo) and "speculative-decoding" in (repo / "README.md").read_text()
    with pytest.raises(TypeError, match="unexpected options"):
        drafter.push_to_hub("x", max_shard_size="1GB")
