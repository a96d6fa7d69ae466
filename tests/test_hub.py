"""Drafters as a Hugging Face user meets them: in `pipeline()` (by object or path, one prompt or a batch), loading
targets by dtype name, progress bars, and pushed to a Hub (a local stand-in for its API) with code and a real card."""

import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
from conftest import make_target
from transformers import pipeline

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter, load_drafter
from angelspec_hf.hub import SHIPPED_DRAFTERS


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


@pytest.mark.slow
def test_text_generation_pipeline_loads_every_shipped_card_by_name_and_by_folder(monkeypatch):
    """`pipeline(..., assistant_model="<shipped card name>")` (or its folder) on the real target: each card carries the
    target's tokenizer (which the pipeline loads beside the model, then drops: the vocabularies are one) and its
    `architectures`, and the output is the target's. D-cut reads a fixed profile of this target's shape (profiling
    the untuned target would take seconds and is tested where it is the subject)."""
    from test_lossless import REAL_PROFILE

    from angelspec_hf import load_target
    from angelspec_hf.generation import policies
    from angelspec_hf.hub import shipped_drafter_path

    monkeypatch.setattr(policies, "load_cost_model", lambda target, rows=(1,): REAL_PROFILE)

    target = load_target("smollm2", tune_kernels=False)  # outputs are compared, not timed
    options = dict(max_new_tokens=8, do_sample=False, return_full_text=False)
    plain = pipeline("text-generation", model=target.model, tokenizer=target.tokenizer)(PROMPTS[:1], **options)
    for assistant in (*SHIPPED_DRAFTERS, shipped_drafter_path(SHIPPED_DRAFTERS[0])):
        assisted = pipeline(
            "text-generation", model=target.model, tokenizer=target.tokenizer, assistant_model=assistant
        )
        assert assisted.assistant_tokenizer is None, assistant
        assert assisted(PROMPTS[:1], **options) == plain, assistant


@pytest.mark.slow
def test_a_gguf_target_is_converted_once_and_loads_as_the_file_does():
    """The embedded GGUF target is converted to a transformers folder in the cache on first load (the run's cache:
    whichever test loads it first converts it) and loaded from it afterwards: same logits, tokenizer, chat template,
    generation config, context and hidden-state cache key as the GGUF file itself; the commands' context check reads
    it too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from angelspec_hf import load_target
    from angelspec_hf.hub import shipped_drafter_path
    from angelspec_hf.targets import (
        SMOLLM2_GGUF_FILE,
        converted_gguf_directory,
        load_target_tokenizer,
        smollm2_directory,
        target_context_length,
        tokenizer_fingerprint,
    )
    from angelspec_hf.training.data import target_fingerprint

    converted = load_target("smollm2", tune_kernels=False)
    assert os.path.isfile(
        os.path.join(converted_gguf_directory(smollm2_directory(), SMOLLM2_GGUF_FILE), "config.json")
    )
    assert converted.model.config.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert not hasattr(converted.model.config, "quantization_config")
    direct = AutoModelForCausalLM.from_pretrained(smollm2_directory(), gguf_file=SMOLLM2_GGUF_FILE)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_directory(), gguf_file=SMOLLM2_GGUF_FILE)
    ids = torch.tensor([[1, 2, 3, 400, 5000, 49000]])
    assert torch.equal(converted.model(ids).logits, direct(ids).logits)
    assert target_fingerprint(converted.model) == target_fingerprint(direct)  # one hidden-state cache for both
    assert converted.tokenizer.get_vocab() == tokenizer.get_vocab() == load_target_tokenizer("smollm2").get_vocab()
    assert converted.tokenizer.chat_template == tokenizer.chat_template
    # the copy each shipped card carries (the tests' `smollm2_tokenizer`) is the GGUF file's tokenizer
    for name in SHIPPED_DRAFTERS:
        card = AutoTokenizer.from_pretrained(shipped_drafter_path(name))
        assert tokenizer_fingerprint(card) == tokenizer_fingerprint(tokenizer), name
        assert card.chat_template == tokenizer.chat_template, name
    assert converted.model.generation_config.to_dict() == direct.generation_config.to_dict()
    assert target_context_length("smollm2") == direct.config.max_position_embeddings == 8192


def test_a_gguf_conversion_replaces_unfinished_remains_and_falls_back_where_the_cache_is_read_only(
    text_target, smollm2_tokenizer, tmp_path, monkeypatch, caplog
):
    """The conversion is written into a staging folder renamed when complete (an interrupted one's remains are
    replaced, no staging folder is left); where the cache cannot be written the GGUF file is loaded, with a warning."""
    from angelspec_hf import targets

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    loads = []
    monkeypatch.setattr(targets.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: smollm2_tokenizer)
    monkeypatch.setattr(
        targets.AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: loads.append(kwargs) or text_target
    )
    monkeypatch.setenv("ANGELSPEC_CACHE", str(tmp_path / "cache"))
    folder = targets.converted_gguf_directory(str(tmp_path), "model.gguf")
    os.makedirs(folder)
    open(os.path.join(folder, "config.json"), "w").close()  # a conversion killed before its rename
    assert targets._converted(str(tmp_path), "model.gguf") == folder
    assert sorted(os.listdir(folder)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
        + (["chat_template.jinja"] if smollm2_tokenizer.chat_template else [])
    )
    assert sorted(os.listdir(os.path.dirname(folder))) == [
        os.path.basename(folder),
        f"{os.path.basename(folder)}.lock",
    ]
    assert len(loads) == 1
    assert targets._converted(str(tmp_path), "model.gguf") == folder and len(loads) == 1  # cached: not loaded again

    gguf.write_bytes(b"GGUF, changed")  # another file: another folder, in a cache that cannot be written
    monkeypatch.setattr(
        targets.os, "makedirs", lambda *args, **kwargs: (_ for _ in ()).throw(PermissionError("read-only"))
    )
    with caplog.at_level("WARNING"):
        assert targets._converted(str(tmp_path), "model.gguf") is None
    assert "loading the GGUF file" in caplog.text


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
    saved = {p.name for p in (tmp_path / "my-drafter").iterdir()}
    assert (
        saved | {"README.md"} <= set(os.listdir(repo)) and "speculative-decoding" in (repo / "README.md").read_text()
    )
    # the code goes to the Hub, written as it is published; the local folder holds none
    assert "modeling_mtp.py" in os.listdir(repo) and not [name for name in saved if name.endswith(".py")]
    with pytest.raises(TypeError, match="unexpected options"):
        drafter.push_to_hub("x", max_shard_size="1GB")


def test_a_router_naming_members_saved_elsewhere_is_published_with_them_inside(text_target, local_hub, tmp_path):
    from test_router import make_router
    from transformers import AutoModel

    router = make_router(text_target)
    router.members[0].save_pretrained(tmp_path / "mtp")
    router.save_pretrained(tmp_path / "router", member_paths={"mtp": "../mtp"})
    router.push_to_hub("me/router", folder=str(tmp_path / "router"))
    repo = local_hub / "me" / "router"
    assert sorted(os.listdir(repo / "members")) == ["dfly", "mtp", "suffix"]
    assert json.loads((repo / "config.json").read_text())["member_paths"] == [
        f"members/{name}" for name in ("mtp", "dfly", "suffix")
    ]
    assert "modeling_mtp.py" in os.listdir(repo / "members" / "mtp") and "modeling_router.py" in os.listdir(repo)
    assert [type(m).__name__ for m in AutoModel.from_pretrained(repo).members] == [
        "AngelSpecMTPDrafter",
        "DFlyDrafter",
        "SuffixDrafter",
    ]


REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_shipped_drafters_are_found_by_name_after_a_normal_install(tmp_path):
    """A wheel built from the repository and installed (not editable) into a scratch prefix carries the shipped
    cards: run from elsewhere, `load_drafter(name)` loads each from the installed copy, not the repository."""
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, REPOSITORY],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    prefix = tmp_path / "prefix"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "-q",
            "--prefix",
            prefix,
        ]
        + [str(wheel) for wheel in tmp_path.glob("*.whl")],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    site = next(prefix.glob("lib/python*/site-packages"))
    code = (
        "import angelspec_hf, os\n"
        "from angelspec_hf.hub import SHIPPED_DRAFTERS\n"
        f"assert angelspec_hf.__file__.startswith({str(site)!r}), angelspec_hf.__file__\n"
        "for name in SHIPPED_DRAFTERS:\n"
        "    drafter = angelspec_hf.load_drafter(name)\n"
        f"    print(name, type(drafter).__name__, drafter.name_or_path.startswith({str(prefix)!r}))\n"
        "from transformers import AutoModel\n"  # a shipped name where transformers takes a Hub id: the installed card
        "auto = AutoModel.from_pretrained('smollm2-135m-instruct-mtp')\n"
        "installed = angelspec_hf.load_drafter('smollm2-135m-instruct-mtp')\n"
        "assert type(auto).__name__ == 'AngelSpecMTPDrafter' and all(\n"
        "    a.equal(b) for a, b in zip(auto.state_dict().values(), installed.state_dict().values()))\n"
    )

    def run_installed(source: str) -> str:
        """`source` run by a fresh interpreter outside the clone, on the installed copy; its output."""
        result = subprocess.run(
            [sys.executable, "-c", source],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(site)},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    with open(os.path.join(REPOSITORY, "README.md")) as handle:  # the quick start, verbatim, from elsewhere
        quick_start = re.search(r"## Quick start\n\n```python\n(.*?)```", handle.read(), re.S).group(1)
    # one interpreter for both (each start imports torch and transformers): the names first, then the quick start
    output = run_installed(code + "print('QUICK START')\n" + quick_start)
    names, quick_start_output = output.split("QUICK START\n")
    lines = [line.split() for line in names.splitlines()]
    assert [line[0] for line in lines] == list(SHIPPED_DRAFTERS) and all(line[2] == "True" for line in lines)
    assert {line[1] for line in lines} == {"AngelSpecMTPDrafter", "DFlyDrafter", "SuffixDrafter", "RouterDrafter"}
    assert re.search(r"'tau': \d", quick_start_output), (
        quick_start_output
    )  # the decoded text, then the call's statistics


def test_load_drafter_names_what_it_accepts():
    with pytest.raises(FileNotFoundError, match="shipped drafter .*smollm2-135m-instruct-mtp"):
        load_drafter("no-such-drafter")
    assert type(load_drafter("smollm2-135m-instruct-suffix")).__name__ == "SuffixDrafter"  # the checkout's card


@pytest.mark.parametrize(
    "imports",
    [
        "import angelspec_hf; from transformers import AutoConfig, AutoModel",
        "from transformers import AutoConfig, AutoModel; import angelspec_hf",
        "import transformers; import angelspec_hf; from transformers import AutoConfig, AutoModel",
        "import angelspec_hf; from transformers import pipeline, AutoConfig, AutoModel",
    ],
)
def test_import_angelspec_hf_registers_the_drafters_in_any_import_order(text_target, tmp_path, imports):
    """`import angelspec_hf` imports no torch, yet AutoConfig / AutoModel load a drafter folder (and the pipeline
    resolves its class by name) however the imports are ordered."""
    AngelSpecMTPDrafter.from_target(text_target, num_depths=1).save_pretrained(tmp_path)
    code = (
        "import sys; import angelspec_hf; print('torch' in sys.modules)\n"
        f"{imports}\n"
        f"print(type(AutoConfig.from_pretrained({str(tmp_path)!r})).__name__)\n"
        f"print(type(AutoModel.from_pretrained({str(tmp_path)!r})).__module__.split('.')[0])\n"
        "import transformers; print(transformers.AngelSpecMTPDrafter is angelspec_hf.AngelSpecMTPDrafter)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-4:] == ["False", "AngelSpecMTPConfig", "angelspec_hf", "True"]


@pytest.mark.parametrize(
    "imports", ["import angelspec_hf; import transformers", "import transformers; import angelspec_hf"]
)
def test_transformers_finds_the_shipped_cards_by_name(tmp_path, imports):
    """A shipped card's name, or a clone's path to it, is a name transformers takes wherever it takes a Hub id:
    `AutoConfig`, `AutoModel` (the router with its members), `AutoTokenizer`, `GenerationConfig`, run from a folder
    that is not the clone, whichever of the two packages is imported first; other names still go to the Hub."""
    code = (
        f"{imports}\n"
        "from transformers import AutoConfig, AutoModel, AutoTokenizer, GenerationConfig\n"
        "from angelspec_hf.hub import SHIPPED_DRAFTERS\n"
        "for name in SHIPPED_DRAFTERS:\n"
        "    print(name, type(AutoModel.from_pretrained(name)).__name__, AutoConfig.from_pretrained(name).model_type)\n"
        "print(type(AutoModel.from_pretrained('/elsewhere/model_cards/smollm2-135m-instruct-mtp')).__name__)\n"
        "print(AutoTokenizer.from_pretrained(SHIPPED_DRAFTERS[0]).eos_token)\n"
        "print(GenerationConfig.from_pretrained(SHIPPED_DRAFTERS[0]).num_assistant_tokens_schedule)\n"
        "try:\n"
        "    AutoConfig.from_pretrained('no-such-card')\n"
        "except OSError as error:\n"
        "    print('to the Hub', 'huggingface.co' in str(error))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:4]] == [
        ["smollm2-135m-instruct-mtp", "AngelSpecMTPDrafter"],
        ["smollm2-135m-instruct-dfly", "DFlyDrafter"],
        ["smollm2-135m-instruct-suffix", "SuffixDrafter"],
        ["smollm2-135m-instruct-router", "RouterDrafter"],
    ]
    assert lines[4:] == ["AngelSpecMTPDrafter", "<|im_end|>", "dcut", "to the Hub True"]


@pytest.mark.parametrize("wrapped", ["target", "drafter"])
def test_lora_wrapped_targets_and_drafters_keep_generating(wrapped):
    """A peft `PeftModel` target (LoRA on its attention) or a LoRA-wrapped drafter: speculative decoding drafts, one
    sequence and a batch, and every output equals the (wrapped) target's own greedy decoding."""
    peft = pytest.importorskip("peft")
    target = make_target("llama", num_hidden_layers=4, dtype=torch.float32)
    torch.manual_seed(0)
    drafter = AngelSpecMTPDrafter.from_target(target, num_depths=2)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    assistant = drafter
    if wrapped == "target":  # random LoRA weights (init_lora_weights=False): the adapted target differs from the base
        config = peft.LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        target = peft.get_peft_model(target, config)
    else:
        config = peft.LoraConfig(target_modules=drafter.lora_target_modules(), init_lora_weights=False)
        assistant = peft.get_peft_model(drafter, config)
    options = dict(max_new_tokens=12, do_sample=False)
    single = dict(input_ids=torch.tensor([[3, 5, 7, 9, 11]]))
    batch = dict(
        input_ids=torch.tensor([[0, 3, 5, 7], [4, 8, 2, 6]]), attention_mask=torch.tensor([[0, 1, 1, 1], [1] * 4])
    )
    for inputs in (single, batch):
        plain = target.generate(**inputs, **options)
        assert torch.equal(target.generate(**inputs, assistant_model=assistant, **options), plain)
        assert sum(drafter.speculation_stats.drafted) > 0


def test_shipped_cards_resolve_by_name_and_by_a_clones_path_to_them(tmp_path):
    """A shipped card's name, or a clone's `.../model_cards/<name>` path where that folder is not (a LoRA adapter's
    base, a training config written in a clone), resolves to the card this install ships; a Hub id of the same name
    stays a Hub id. A LoRA adapter recording such a path loads, and `init_from` takes a name."""
    import peft

    from angelspec_hf.hub import resolve_drafter, shipped_drafter_path

    shipped = shipped_drafter_path("smollm2-135m-instruct-mtp")
    assert resolve_drafter("smollm2-135m-instruct-mtp") == shipped
    assert resolve_drafter("/elsewhere/clone/model_cards/smollm2-135m-instruct-mtp") == shipped
    assert resolve_drafter("someone/smollm2-135m-instruct-mtp") == "someone/smollm2-135m-instruct-mtp"
    assert resolve_drafter(str(tmp_path)) == str(tmp_path)

    drafter = load_drafter("smollm2-135m-instruct-mtp")
    shipped_weight = drafter.layer.mlp.down_proj.weight.float().clone()
    config = peft.LoraConfig(target_modules=drafter.lora_target_modules(), init_lora_weights=False)
    peft.get_peft_model(drafter, config).save_pretrained(tmp_path / "adapter")
    adapter_config = tmp_path / "adapter" / "adapter_config.json"
    recorded = json.loads(adapter_config.read_text())
    recorded["base_model_name_or_path"] = "/elsewhere/clone/model_cards/smollm2-135m-instruct-mtp"
    adapter_config.write_text(json.dumps(recorded))
    assert type(load_drafter(str(tmp_path / "adapter"))).__name__ == "PeftModel"
    recorded["base_model_name_or_path"] = "smollm2-135m-instruct-mtp"  # a bare name: peft's own loader takes it too
    adapter_config.write_text(json.dumps(recorded))
    allowed = [type(drafter).__module__]  # peft imports a model class only from the modules it is told to trust
    loaded = peft.AutoPeftModel.from_pretrained(tmp_path / "adapter", import_allowlist=allowed)
    assert type(loaded.base_model.model) is type(drafter)

    sys.path.insert(0, os.path.join(REPOSITORY, "examples"))
    try:
        from train_drafter import DrafterArguments
    finally:
        sys.path.pop(0)
    from angelspec_hf import load_target

    target = load_target("smollm2", tune_kernels=False)  # the weights are compared, not timed
    started = DrafterArguments(init_from="smollm2-135m-instruct-mtp").build(target.model, target.tokenizer)
    assert started.dtype == torch.float32 and torch.equal(started.layer.mlp.down_proj.weight, shipped_weight)
