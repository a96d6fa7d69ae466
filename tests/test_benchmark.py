"""`angelspec bench` end to end on a tiny target: every field present, outputs identical to AR."""

import json
import math

import torch
from conftest import make_target

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter
from angelspec_hf.cli import main as cli_main


def test_bench_reports_each_method_against_ar(smollm2_tokenizer, tmp_path, capsys):
    target = make_target("llama", vocab_size=len(smollm2_tokenizer), dtype=torch.float32, seed=2, eos_token_id=2, pad_token_id=2)
    target.save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    AngelSpecMTPDrafter.from_target(target, smollm2_tokenizer, num_depths=3, draft_vocab_size=256).save_pretrained(
        tmp_path / "drafter"
    )
    DFlyDrafter.from_target(
        target, smollm2_tokenizer, block_size=4, num_draft_layers=1, mask_token_id=0, per_layer_context_mix=False,
        ar_head=False,
    ).save_pretrained(tmp_path / "dflash")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hello."}) + "\n" + json.dumps({"turns": ["Name a colour.", "Why?"]}) + "\n")
    output = tmp_path / "results.json"
    cli_main([
        "bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
        "--drafter", f"{tmp_path / 'dflash'}@fixed-2,dcut,heuristic", "--prompts", str(prompts),
        "--max-new-tokens", "12", "--full-vocab-variant", "--schedules", "dcut,fixed-2,heuristic", "--markdown",
        "--output", str(output),
    ])
    results = json.loads(output.read_text())
    by_name = {method["name"]: method for method in results["methods"]}
    assert list(by_name) == [
        "ar", "mtp:drafter[dcut]", "mtp:drafter[fixed-2]", "mtp:drafter[heuristic]", "mtp:drafter+full-vocab-head[dcut]",
        "dflash:dflash[fixed-2]", "dflash:dflash[dcut]", "dflash:dflash[heuristic]", "transformers-dflash:dflash",
    ]
    assert results["num_prompts"] == 2 and results["methods"][0]["tau"] == 1.0
    for method in results["methods"]:
        for key in ("tau", "tokens_per_s", "speedup", "identical_fraction"):
            assert math.isfinite(method[key]), (method["name"], key)
        assert isinstance(method["acceptance_by_depth"], list)
    for speculative in results["methods"][1:]:
        assert speculative["identical_fraction"] == 1.0 and speculative["divergences"] == 0
        assert speculative["tau"] >= 1.0 and speculative["target_forwards"] > 0
    for name in ("mtp:drafter[fixed-2]", "dflash:dflash[fixed-2]"):  # every round verifies exactly two drafts
        assert len(by_name[name]["acceptance_by_depth"]) == 2 and 0.0 < by_name[name]["draft_fraction"] < 1.0
    for name in ("mtp:drafter[dcut]", "mtp:drafter[heuristic]", "dflash:dflash[dcut]", "dflash:dflash[heuristic]"):
        assert len(by_name[name]["acceptance_by_depth"]) <= 3
    dflash_split = by_name["dflash:dflash[fixed-2]"]["time_split"]
    assert set(dflash_split) == {"draft_backbone", "draft_head", "target_forward", "other"}
    assert 0.0 < dflash_split["target_forward"] < 1.0 and abs(sum(dflash_split.values()) - 1.0) < 1e-6
    assert results["machine"]["torch"] == torch.__version__
    assert len(results["verify_cost"]["seconds"][0]) == len(results["verify_cost"]["tokens"])
    calibration = by_name["mtp:drafter[dcut]"]["calibration"]
    assert len(calibration) == 10 and "calibration" not in by_name["mtp:drafter[fixed-2]"]
    printed = capsys.readouterr().out
    assert "mtp:drafter[dcut]" in printed and "| transformers-dflash:dflash |" in printed
