"""Loading drafters: a checkpoint must hold exactly the drafter's tensors, and a malformed config is refused by name."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import make_target
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from angelspec_hf import AngelSpecMTPConfig, AngelSpecMTPDrafter, DFlyConfig, DFlyDrafter


DFLY_ARGS = dict(block_size=4, num_draft_layers=1, mask_token_id=3, num_target_layers_tapped=2)


def save_mtp(directory, **config_kwargs):
    drafter = AngelSpecMTPDrafter.from_target(make_target("llama", num_hidden_layers=4), **config_kwargs)
    drafter.save_pretrained(directory)
    return drafter


def edit_weights(directory, edit):
    """Rewrite `model.safetensors` in `directory` with `edit` applied to its tensors."""
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(directory, edit):
    """Rewrite `config.json` in `directory` with `edit` applied to its values."""
    path = os.path.join(directory, "config.json")
    with open(path) as handle:
        config = json.load(handle)
    edit(config)
    with open(path, "w") as handle:
        json.dump(config, handle)


def test_complete_checkpoint_loads_and_still_reports_loading_info(tmp_path):
    save_mtp(tmp_path, draft_vocab_size=32)
    drafter, info = AngelSpecMTPDrafter.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(drafter, AngelSpecMTPDrafter) and not info["missing_keys"] and not info["unexpected_keys"]
    assert isinstance(AutoModel.from_pretrained(tmp_path), AngelSpecMTPDrafter)


def test_checkpoint_missing_a_tensor_is_refused_naming_it(tmp_path):
    save_mtp(tmp_path, draft_vocab_size=32)
    edit_weights(tmp_path, lambda tensors: tensors.pop("fusion.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: fusion\.weight$"):
        AngelSpecMTPDrafter.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"missing tensors: fusion\.weight$"):
        AutoModel.from_pretrained(tmp_path)


def test_checkpoint_with_an_extra_tensor_is_refused_naming_it(tmp_path):
    save_mtp(tmp_path)
    edit_weights(tmp_path, lambda tensors: tensors.update({"extra_head.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: extra_head\.weight$"):
        AutoModel.from_pretrained(tmp_path)


def test_dfly_config_over_mtp_weights_is_refused_naming_the_tensors(tmp_path):
    target = make_target("llama", num_hidden_layers=4)
    AngelSpecMTPDrafter.from_target(target).save_pretrained(tmp_path / "mtp")
    DFlyDrafter.from_target(target, **DFLY_ARGS).save_pretrained(tmp_path / "dfly")
    os.replace(tmp_path / "mtp" / "model.safetensors", tmp_path / "dfly" / "model.safetensors")
    with pytest.raises(ValueError, match="DFlyDrafter") as error:
        AutoModel.from_pretrained(tmp_path / "dfly")
    missing, unexpected = str(error.value).split("missing tensors: ")[1].split("; unexpected tensors: ")
    assert {"context.fc.weight", "layers.0.mlp.up_proj.weight"} <= set(missing.split(", "))
    assert {"fusion.weight", "layer.mlp.up_proj.weight"} <= set(unexpected.split(", "))


def test_remote_code_refuses_a_checkpoint_missing_a_tensor(tmp_path, packageless_python):
    AngelSpecMTPDrafter.from_target(make_target("llama", num_hidden_layers=4), num_depths=2).save_pretrained(
        tmp_path, remote_code=True
    )
    edit_weights(tmp_path, lambda tensors: tensors.pop("norm.weight"))
    # where the package cannot be imported, the folder's own code loads it
    _, error = packageless_python.run(
        f"from transformers import AutoModel\nAutoModel.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)\n"
    )
    assert error is not None and "ValueError" in error and "missing tensors: norm.weight" in error, error


def test_config_json_without_target_config_is_refused_naming_it(tmp_path):
    save_mtp(tmp_path)
    edit_config(tmp_path, lambda config: config.pop("target_config"))
    with pytest.raises(ValueError, match="no target_config"):
        AutoModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no target_config"):
        AngelSpecMTPDrafter(AngelSpecMTPConfig())


@pytest.mark.parametrize(
    "target_config, message",
    [
        ("llama", "target_config must be the target's text config"),
        ({"model_type": "llama", "vocab_size": 96, "num_hidden_layers": 2}, "target_config lacks hidden_size"),
        (
            {"model_type": "llama", "hidden_size": 64, "vocab_size": 0, "num_hidden_layers": 2},
            r"target_config\['vocab_size'\] must be an integer at least 1",
        ),
    ],
)
def test_malformed_target_config_is_refused_naming_it(target_config, message):
    with pytest.raises(ValueError, match=message):
        AngelSpecMTPConfig(target_config=target_config)


def test_zero_depths_is_refused_naming_num_depths(tmp_path):
    with pytest.raises(ValueError, match="num_depths must be an integer at least 1, got 0"):
        AngelSpecMTPDrafter.from_target(make_target("llama"), num_depths=0)
    save_mtp(tmp_path)
    edit_config(tmp_path, lambda config: config.update(num_depths=0))
    with pytest.raises(ValueError, match="num_depths"):
        AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_depths"):
        AutoModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_depths", "3"),
        ("training_time_test", "yes"),
        ("depth_loss_weights", [0.5, -0.5, 1.0]),
        ("draft_vocab_size", 0),
        ("draft_vocab_size", 1000),
        ("kl_top_k", 0),
        ("lk_eta", -1.0),
    ],
)
def test_bad_mtp_fields_are_refused_naming_them(field, value):
    with pytest.raises(ValueError, match=field):
        AngelSpecMTPDrafter.from_target(make_target("llama"), **{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", "16"),
        ("num_draft_layers", 0),
        ("num_target_layers_tapped", 0),
        ("target_layer_ids", []),
        ("mask_token_id", "5"),
        ("per_layer_context_mix", None),
        ("position_decay_gamma", 0.0),
        ("anchors_per_row", 0),
    ],
)
def test_bad_dfly_fields_are_refused_naming_them(field, value):
    with pytest.raises(ValueError, match=field):
        DFlyDrafter.from_target(make_target("llama", num_hidden_layers=4), **{**DFLY_ARGS, field: value})


@pytest.mark.parametrize("config_class", [AngelSpecMTPConfig, DFlyConfig])
def test_default_configs_still_build_and_serialise(config_class, tmp_path):
    """transformers builds configs without arguments (defaults, diffs): validation must let them through."""
    config = config_class()
    assert json.loads(config.to_json_string())["model_type"] == config_class.model_type
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).to_diff_dict() == config.to_diff_dict()


def test_a_folder_of_unknown_model_type_is_refused_without_running_its_code(tmp_path):
    """`load_drafter` (and so every command) passes trust_remote_code=False: the folder's code never runs and no
    "run custom code? [y/N]" prompt waits on a terminal."""
    from angelspec_hf import load_drafter

    folder = tmp_path / "strange"
    folder.mkdir()
    marker = tmp_path / "code_ran"
    (folder / "config.json").write_text(
        json.dumps(
            {"model_type": "strange_drafter", "auto_map": {"AutoConfig": "strange.C", "AutoModel": "strange.M"}}
        )
    )
    (folder / "strange.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_drafter(str(folder))
    assert not marker.exists()


@pytest.mark.parametrize(
    "module",
    [
        "angelspec_hf.cache_utils",
        "angelspec_hf.generation.verify_cost",
        "angelspec_hf.generation.engine",
        "angelspec_hf.export",
        "angelspec_hf.training.data",
    ],
)
def test_a_helper_module_imported_first_in_a_fresh_interpreter_imports(module):
    """Importing a transformers model module runs transformers' Auto lookups, which import the drafters, which import
    these helpers: none of them may import a model module at its own import (a cycle only a fresh process shows)."""
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
