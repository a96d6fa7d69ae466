"""`angelspec suite` end to end on a tiny target and a tiny data folder: every method present, numbers finite, a
failing drafter reported with its error while the rest completes, plots and the Markdown report written."""

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import make_target
from transformers import AutoModel, AutoModelForCausalLM

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


def make_cards(tmp_path, tokenizer):
    """A tiny target saved under `tmp_path/target` and every shipped drafter kind for it under `tmp_path/cards`
    (the MTP-without-TTT card built for another target, so that its method fails)."""
    target = make_target(
        "llama", vocab_size=len(tokenizer), dtype=torch.float32, seed=7, eos_token_id=2, pad_token_id=2
    )
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    cards = tmp_path / "cards"
    AngelSpecMTPDrafter.from_target(target, tokenizer, num_depths=2).save_pretrained(
        cards / suite.DRAFTER_CARDS["mtp"]
    )
    DFlyDrafter.from_target(target, tokenizer, block_size=4, num_draft_layers=1, mask_token_id=0).save_pretrained(
        cards / suite.DRAFTER_CARDS["dfly"]
    )
    DFlyDrafter.from_target(
        target,
        tokenizer,
        block_size=4,
        num_draft_layers=1,
        mask_token_id=0,
        per_layer_context_mix=False,
        ar_head=False,
    ).save_pretrained(cards / suite.DRAFTER_CARDS["dflash"])
    other = make_target("llama", vocab_size=len(tokenizer), dtype=torch.float32, hidden_size=32, head_dim=8)
    AngelSpecMTPDrafter.from_target(other, tokenizer, num_depths=2).save_pretrained(
        cards / suite.DRAFTER_CARDS["mtp-no-ttt"]
    )
    SuffixDrafter.from_target(target, tokenizer).save_pretrained(cards / suite.DRAFTER_CARDS["suffix"])
    RouterDrafter.from_members(
        [AutoModel.from_pretrained(cards / suite.DRAFTER_CARDS[kind]) for kind in ("mtp", "dfly", "suffix")]
    ).save_pretrained(cards / suite.DRAFTER_CARDS["router"])
    write_tiny_data(tmp_path / "data")
    return cards


TINY = suite.SuiteSize(
    1,
    6,
    (1, 2),
    4,
    {"mtp": ("constant-1", "dcut"), "dfly": ("constant-2", "dcut"), "suffix": ("dcut",), "router": ("dcut",)},
    2,
    engine_requests=8,
    engine_repeats=2,
)


def suite_command(tmp_path, *extra):
    return [
        "suite",
        "--quick",
        "--target",
        str(tmp_path / "target"),
        "--drafters-dir",
        str(tmp_path / "cards"),
        "--data-dir",
        str(tmp_path / "data"),
        "--output-dir",
        str(tmp_path / "out"),
        "--benchmarks-md",
        str(tmp_path / "BENCHMARKS.md"),
        *extra,
    ]


@pytest.mark.slow
def test_quick_suite_runs_every_method_and_reports_a_failing_one(smollm2_tokenizer, tmp_path, monkeypatch, capsys):
    cards = make_cards(tmp_path, smollm2_tokenizer)
    (cards / suite.DRAFTER_CARDS["mtp"] / "README.md").write_text(
        "# MTP\n\nIntro.\n\n"
        + suite.CARD_SECTION_START
        + "\nstale numbers\n"
        + suite.CARD_SECTION_END
        + "\n\n## Training\nKept.\n"
    )
    (cards / suite.DRAFTER_CARDS["dfly"] / "README.md").write_text("# DFly\n")
    monkeypatch.setattr(suite, "QUICK", TINY)
    cli_main(suite_command(tmp_path, "--ablations", "--update-model-cards"))
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(report["domains"]) == list(suite.SPEC_BENCH_CATEGORIES) + ["gsm8k", "mbpp"]
    assert report["pending"] == [] and "Incomplete" not in (tmp_path / "BENCHMARKS.md").read_text()
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


@pytest.mark.slow
def test_a_suite_cut_off_resumes_at_the_next_unmeasured_part(smollm2_tokenizer, tmp_path, monkeypatch, package_log):
    cards = make_cards(tmp_path, smollm2_tokenizer)
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    methods, _ = suite.suite_methods(SimpleNamespace(model=target, tokenizer=smollm2_tokenizer), str(cards))
    assert [method.name for method in methods] == [  # the default methods: no ablations
        "prompt-lookup[3]",
        "mtp:smollm2-135m-instruct-mtp[dcut]",
        "dflash:smollm2-135m-instruct-dflash[dcut]",
        "dfly:smollm2-135m-instruct-dfly[dcut]",
        "suffix:smollm2-135m-instruct-suffix[dcut]",
        "router:smollm2-135m-instruct-router[dcut]",
    ]
    # Resuming, timed on the cheapest drafter.
    monkeypatch.setattr(suite, "DRAFTER_CARDS", {"suffix": suite.DRAFTER_CARDS["suffix"]})
    monkeypatch.setattr(
        suite, "QUICK", dataclasses.replace(TINY, engine_policies={"suffix": ("dcut",)}, concurrencies=(2,), repeats=1)
    )
    measured, measure = [], suite.run_benchmark

    def counted(target, tokenizer, methods, prompts, *args, **kwargs):
        measured.append(prompts[0])
        if len(measured) == 3 and cut_off:
            raise KeyboardInterrupt  # the session ends during the third domain
        return measure(target, tokenizer, methods, prompts, *args, **kwargs)

    monkeypatch.setattr(suite, "run_benchmark", counted)
    engine_runs, run_engine = [], suite.run_engine_benchmark
    monkeypatch.setattr(suite, "run_engine_benchmark", lambda *a, **k: engine_runs.append(1) or run_engine(*a, **k))
    cut_off = True
    with pytest.raises(KeyboardInterrupt):
        cli_main(suite_command(tmp_path))
    partial = json.loads((tmp_path / "out" / "results.json").read_text())
    domains = list(suite.SPEC_BENCH_CATEGORIES) + ["gsm8k", "mbpp"]
    assert list(partial["domains"]) == domains[:2] and partial["pending"] == [*domains[2:], "engine"]
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert f"**Incomplete**: still to measure: {', '.join(domains[2:])}, engine." in page and "## qa" not in page
    assert "![" not in page, "plots are drawn when the suite is complete"
    cut_off, measured[:] = False, []
    with package_log.silent():
        cli_main(suite_command(tmp_path))
    assert len(measured) == len(domains) - 2 and engine_runs == [1]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(report["domains"]) == domains and report["pending"] == []
    assert report["domains"]["mt_bench"] == partial["domains"]["mt_bench"]  # kept, not measured again
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert "Incomplete" not in page and "## Batched engine" in page and page.count("Measured 20") == len(domains) + 1
    assert "![speedup_by_domain.png](out/speedup_by_domain.png)" in page

    # A part that cannot be read is measured again; the others are kept.
    (tmp_path / "out" / "parts" / "qa.json").write_text('{"key": ')
    measured[:] = []
    with package_log.warns("qa.json is unreadable"):
        cli_main(suite_command(tmp_path))
    assert len(measured) == 1 and engine_runs == [1]
    # Another size measures everything again.
    measured[:] = []
    with package_log.warns("measured with another size; measuring mt_bench again"):
        cli_main(suite_command(tmp_path, "--max-new-tokens", "3"))
    assert len(measured) == len(domains) and engine_runs == [1, 1]
    # Other code (an edit, another commit) measures everything again.
    monkeypatch.setattr(suite, "code_fingerprint", lambda: "edited")
    measured[:] = []
    with package_log.warns("measured with another code; measuring mt_bench again"):
        cli_main(suite_command(tmp_path, "--max-new-tokens", "3"))
    assert len(measured) == len(domains) and engine_runs == [1, 1, 1]


def test_a_drafter_changed_since_a_part_was_measured_is_measured_again(smollm2_tokenizer, tmp_path):
    """The parts' key holds a digest of each drafter's tensors: a retrained card is never reported with old numbers."""
    target = make_target("llama", vocab_size=len(smollm2_tokenizer), dtype=torch.float32)
    drafter = AngelSpecMTPDrafter.from_target(target, smollm2_tokenizer, num_depths=2)
    digest = suite.drafter_fingerprint(drafter)
    assert suite.drafter_fingerprint(drafter) == digest
    with torch.no_grad():
        next(drafter.parameters()).view(-1)[0] += 1.0
    assert suite.drafter_fingerprint(drafter) != digest
    suffix = SuffixDrafter.from_target(target, smollm2_tokenizer)
    suffix.save_pretrained(tmp_path / "empty")
    suffix.record_output(list(range(3, 40)))
    suffix.save_pretrained(tmp_path / "seeded")
    digests = {suite.drafter_fingerprint(AutoModel.from_pretrained(tmp_path / name)) for name in ("empty", "seeded")}
    assert len(digests) == 2  # its shared index is part of what it is


def test_model_cards_the_run_did_not_measure_keep_their_suite_section(tmp_path):
    section = suite.CARD_SECTION_START + "\nearlier numbers\n" + suite.CARD_SECTION_END + "\n"
    for kind in ("suffix", "mtp-no-ttt"):
        (tmp_path / suite.DRAFTER_CARDS[kind]).mkdir()
        (tmp_path / suite.DRAFTER_CARDS[kind] / "README.md").write_text(f"# {kind}\n\n" + section)
    method = {
        "name": "suffix:smollm2-135m-instruct-suffix[dcut]",
        "failed": True,
        "error": "ValueError: for another target",
    }
    report = {
        "domains": {"qa": {"methods": [{"name": "ar", "failed": True, "error": "-"}, method]}},
        "engine": {"concurrency": []},
        "size": {"prompts_per_domain": 1, "max_new_tokens": 4},
        "machine": {"threads": 1},
    }
    updated = suite.update_model_cards(report, str(tmp_path))
    assert updated == [str(tmp_path / suite.DRAFTER_CARDS["suffix"] / "README.md")]
    assert "earlier numbers" in (tmp_path / suite.DRAFTER_CARDS["mtp-no-ttt"] / "README.md").read_text()
    suffix_card = (tmp_path / suite.DRAFTER_CARDS["suffix"] / "README.md").read_text()
    assert (
        "earlier numbers" not in suffix_card
        and "| qa | suffix:smollm2-135m-instruct-suffix[dcut] | failed" in suffix_card
    )
