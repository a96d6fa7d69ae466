"""`angelspec suite` end to end on a tiny target and a tiny data folder: every method present, numbers finite, a
failing drafter reported with its error while the rest completes, plots and the Markdown report written."""

import json
import math

import torch
from conftest import make_target
from transformers import AutoModel

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter, RouterDrafter, SuffixDrafter
from angelspec_hf.benchmark import suite
from angelspec_hf.cli import main as cli_main


def write_tiny_data(root):
    """A few records per file, in the formats of ../shared/data."""

    def jsonl(path, records):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    categories = list(suite.MT_BENCH_SUBCATEGORIES[:2]) + list(suite.SPEC_BENCH_CATEGORIES[1:])
    jsonl(
        root / "spec_bench" / "question.jsonl",
        [
            {"question_id": i, "category": c, "turns": [f"Question {i} about {c}.", "More?"]}
            for i, c in enumerate(categories)
        ],
    )
    jsonl(
        root / "mt_bench" / "question.jsonl",
        [{"category": "writing", "turns": [f"Write haiku {i}.", "Again."]} for i in range(3)],
    )
    jsonl(root / "gsm8k" / "test.jsonl", [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)])
    jsonl(
        root / "mbpp" / "mbpp.jsonl",
        [
            {
                "task_id": 11 + i,
                "text": f"Write a function returning {i}.",
                "code": "",
                "test_list": [f"assert f() == {i}"],
            }
            for i in range(3)
        ],
    )


def test_quick_suite_runs_every_method_and_reports_a_failing_one(smollm2_tokenizer, tmp_path, monkeypatch, capsys):
    target = make_target(
        "llama", vocab_size=len(smollm2_tokenizer), dtype=torch.float32, seed=7, eos_token_id=2, pad_token_id=2
    )
    target.save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    cards = tmp_path / "cards"
    AngelSpecMTPDrafter.from_target(target, smollm2_tokenizer, num_depths=2).save_pretrained(
        cards / suite.DRAFTER_CARDS["mtp"]
    )
    DFlyDrafter.from_target(
        target, smollm2_tokenizer, block_size=4, num_draft_layers=1, mask_token_id=0
    ).save_pretrained(cards / suite.DRAFTER_CARDS["dfly"])
    DFlyDrafter.from_target(
        target,
        smollm2_tokenizer,
        block_size=4,
        num_draft_layers=1,
        mask_token_id=0,
        per_layer_context_mix=False,
        ar_head=False,
    ).save_pretrained(cards / suite.DRAFTER_CARDS["dflash"])
    other = make_target("llama", vocab_size=len(smollm2_tokenizer), dtype=torch.float32, hidden_size=32, head_dim=8)
    AngelSpecMTPDrafter.from_target(other, smollm2_tokenizer, num_depths=2).save_pretrained(
        cards / suite.DRAFTER_CARDS["mtp-no-ttt"]
    )
    SuffixDrafter.from_target(target, smollm2_tokenizer).save_pretrained(cards / suite.DRAFTER_CARDS["suffix"])
    RouterDrafter.from_members(
        [AutoModel.from_pretrained(cards / suite.DRAFTER_CARDS[kind]) for kind in ("mtp", "dfly", "suffix")]
    ).save_pretrained(cards / suite.DRAFTER_CARDS["router"])
    (cards / suite.DRAFTER_CARDS["mtp"] / "README.md").write_text(
        "# MTP\n\nIntro.\n\n"
        + suite.CARD_SECTION_START
        + "\nstale numbers\n"
        + suite.CARD_SECTION_END
        + "\n\n## Training\nKept.\n"
    )
    (cards / suite.DRAFTER_CARDS["dfly"] / "README.md").write_text("# DFly\n")
    write_tiny_data(tmp_path / "data")
    monkeypatch.setattr(
        suite,
        "QUICK",
        suite.SuiteSize(
            1,
            6,
            (1, 2),
            4,
            {"mtp": ("constant-1", "dcut"), "dfly": ("constant-2", "dcut"), "suffix": ("dcut",), "router": ("dcut",)},
            2,
            engine_requests=8,
            engine_repeats=2,
        ),
    )
    cli_main(
        [
            "suite",
            "--quick",
            "--target",
            str(tmp_path / "target"),
            "--drafters-dir",
            str(cards),
            "--data-dir",
            str(tmp_path / "data"),
            "--output-dir",
            str(tmp_path / "out"),
            "--benchmarks-md",
            str(tmp_path / "BENCHMARKS.md"),
            "--update-model-cards",
        ]
    )
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(report["domains"]) == list(suite.SPEC_BENCH_CATEGORIES) + ["gsm8k", "mbpp"]
    expected = {
        "ar",
        "prompt-lookup[3]",
        "assisted-heuristic:early-exit-1of2",
        "mtp:smollm2-135m-instruct-mtp[dcut]",
        "mtp-no-ttt:smollm2-135m-instruct-mtp-no-ttt",
        "dflash:smollm2-135m-instruct-dflash[dcut]",
        "transformers-dflash:smollm2-135m-instruct-dflash",
        "dfly:smollm2-135m-instruct-dfly[dcut]",
        "suffix:smollm2-135m-instruct-suffix[dcut]",
        "router:smollm2-135m-instruct-router[dcut]",
    }
    for domain, result in report["domains"].items():
        assert {m["name"] for m in result["methods"]} == expected, domain
        assert result["repeats"] == 2
        for method in result["methods"]:
            if method["name"].startswith("mtp-no-ttt"):
                assert method["failed"] and "does not match the target" in method["error"]
                continue
            for key in ("tau", "tokens_per_s", "speedup", "identical_fraction", "peak_rss_mib"):
                assert math.isfinite(method[key]), (domain, method["name"], key)
            assert method["identical_fraction"] == 1.0
    summary = report["summary"]
    assert summary["dfly:smollm2-135m-instruct-dfly[dcut]"]["median_speedup"] > 0
    engine_names = [run["name"] for run in report["engine"]["concurrency"][-1]["runs"]]
    assert engine_names == [
        "batched-ar",
        "mtp[constant-1]",
        "mtp[dcut]",
        "dfly[constant-2]",
        "dfly[dcut]",
        "suffix[dcut]",
        "router[dcut]",
    ]
    assert report["engine"]["repeats"] == 2 and all(
        len(run["repeat_tokens_per_s"]) == 2 and run["identical_fraction"] == 1.0
        for level in report["engine"]["concurrency"]
        for run in level["runs"]
    )
    for name in ("speedup_by_domain.png", "acceptance_by_position.png", "throughput_vs_concurrency.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    markdown = (tmp_path / "BENCHMARKS.md").read_text()
    assert (
        "angelspec suite --quick" in markdown
        and "smoke slice" in markdown
        and "![speedup_by_domain.png](out/speedup_by_domain.png)" in markdown
    )
    assert "failed: " in markdown and "| 2 | dfly[dcut] |" in markdown
    # The model cards take their numbers from this run; the rest of each card is kept.
    mtp_card = (cards / suite.DRAFTER_CARDS["mtp"] / "README.md").read_text()
    assert (
        "stale numbers" not in mtp_card
        and mtp_card.startswith("# MTP\n\nIntro.")
        and mtp_card.endswith("## Training\nKept.\n")
    )
    speedup = report["domains"]["gsm8k"]["methods"][3]
    assert speedup["name"] == "mtp:smollm2-135m-instruct-mtp[dcut]"
    assert f"| gsm8k | mtp:smollm2-135m-instruct-mtp[dcut] | {speedup['tau']:.2f} |" in mtp_card
    assert "| 2 | mtp[dcut] |" in mtp_card and "dfly[dcut]" not in mtp_card and "no-ttt" not in mtp_card
    dfly_card = (cards / suite.DRAFTER_CARDS["dfly"] / "README.md").read_text()
    assert (
        dfly_card.count(suite.CARD_SECTION_START) == 1
        and "| mbpp | dfly:smollm2-135m-instruct-dfly[dcut] |" in dfly_card
    )
