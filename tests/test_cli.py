"""`angelspec` reports a mistake in its arguments or input files in one line, with exit status 2, before any model
loads; arguments that are right get through to the model load."""

import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from angelspec_hf import targets
from angelspec_hf.cli import main
from angelspec_hf.prompts import load_prompts


LOAD_TARGET = targets.load_target  # for the one test below that runs a whole command on a tiny target


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(targets, "load_target", refuse)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Tell me about {n}."}) + "\n" for n in range(8)))
    return path


@pytest.fixture
def drafter(tmp_path):
    path = tmp_path / "drafter"
    path.mkdir()
    return path


def usage_error(capsys, *argv) -> str:
    """Run `angelspec *argv`, expect exit status 2 and no traceback; the error line it printed."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in argv])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr and "error: " in stderr
    return stderr.strip().splitlines()[-1]


def one_line_error(capsys, *argv) -> str:
    """As `usage_error`, for a mistake found on disk: a single line, no usage text."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in argv])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and stderr.startswith(f"angelspec {argv[0]}: error: "), stderr
    return stderr.strip()


def batch_error(capsys, tmp_path, prompt_file) -> str:
    return one_line_error(capsys, "batch", "--prompts", prompt_file, "--output", tmp_path / "out.jsonl")


def test_unwritable_output_is_reported_before_the_run(capsys, tmp_path, prompts):
    (tmp_path / "blocker").write_text("a file, not a folder")
    error = one_line_error(capsys, "batch", "--prompts", prompts, "--output", tmp_path / "blocker" / "out.jsonl")
    assert "--output" in error and "blocker is a file" in error
    error = one_line_error(capsys, "bench", "--prompts", prompts, "--output", tmp_path)
    assert "is a folder" in error
    error = one_line_error(capsys, "profile", "--output", tmp_path / "blocker" / "cost.json")
    assert "blocker is a file" in error
    error = one_line_error(capsys, "suite", "--drafters-dir", tmp_path, "--output-dir", tmp_path / "blocker")
    assert "--output-dir" in error and "not a folder" in error


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_read_only_output_folder(capsys, tmp_path, prompts):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    error = one_line_error(capsys, "batch", "--prompts", prompts, "--output", folder / "new" / "out.jsonl")
    assert f"cannot be written, {folder} is read-only" in error


def test_malformed_jsonl_names_its_line(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "Hi."}\n\n{"prompt": "Hello"\n{"prompt": "Later."}\n')
    assert f"{path} line 3: not valid JSON" in batch_error(capsys, tmp_path, path)


def test_record_without_prompt_or_turns(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "Hi."}\n{"question": "Why?"}\n')
    error = batch_error(capsys, tmp_path, path)
    assert f'{path} line 2: a record needs a "prompt" string or a "turns" list; its keys: "question"' in error


@pytest.mark.parametrize("value, shown", [(None, "null"), (42, "42"), ("", '""'), ("  ", '"  "')])
def test_prompt_must_be_a_non_empty_string(capsys, tmp_path, value, shown):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "Hi."}) + "\n" + json.dumps({"prompt": value}) + "\n")
    assert f'{path} line 2: "prompt" must be a non-empty string, got {shown}' in batch_error(capsys, tmp_path, path)


@pytest.mark.parametrize("turns", [[], "Hi.", [1, 2], None])
def test_turns_must_be_a_non_empty_list_of_strings(capsys, tmp_path, turns):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"turns": turns, "prompt": None} if turns is None else {"turns": turns}) + "\n")
    error = batch_error(capsys, tmp_path, path)
    expected = (
        '"prompt" must be a non-empty string' if turns is None else '"turns" must be a non-empty list of strings'
    )
    assert f"{path} line 1: {expected}" in error


def test_non_utf8_file(capsys, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "Hi."}\n{"prompt": "caf\xe9"}\n')
    assert f"{path} line 2: not UTF-8 text (byte 0xe9 at offset 33)" in batch_error(capsys, tmp_path, path)


@pytest.mark.parametrize("content", ["", "\n  \n", "[]"])
def test_empty_prompt_file(capsys, tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    assert f"{path} is empty" in batch_error(capsys, tmp_path, path)


def test_unknown_prompt_source(capsys, tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert f"{missing}: no such prompt file" in batch_error(capsys, tmp_path, missing)
    error = one_line_error(capsys, "regenerate", "--sources", "mt_bench,no_such_set", "--output", tmp_path / "r.gz")
    assert "Unknown prompt source 'no_such_set': not a file and not one of" in error


def test_a_prompt_set_that_can_be_read_from_nowhere_is_named_before_the_target_loads(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("ANGELSPEC_DATA_DIR")  # offline (conftest), no data folder, nothing in the datasets cache
    output = tmp_path / "r.gz"
    error = one_line_error(capsys, "regenerate", "--sources", "mt_bench,alpaca_eval", "--output", output)
    assert "'alpaca_eval' is not shipped with the package" in error and "pass --data-dir" in error
    error = one_line_error(capsys, "batch", "--prompts", "mt_bench+self_instruct", "--output", tmp_path / "out.jsonl")
    assert "'self_instruct' is not shipped" in error
    assert "'mtbench101' is not shipped" in one_line_error(
        capsys, "regenerate", "--sources", "mtbench101", "--output", output
    )
    empty = tmp_path / "empty_data"
    empty.mkdir()
    error = one_line_error(capsys, "regenerate", "--sources", "gsm8k_train", "--data-dir", empty, "--output", output)
    assert "no --data-dir (or $ANGELSPEC_DATA_DIR) holds gsm8k/train.jsonl" in error


def test_a_set_of_dialogues_is_refused_by_the_benchmarks_and_in_a_mixture(capsys, tmp_path):
    error = one_line_error(capsys, "bench", "--prompts", "mtbench101_later_turns")
    assert "mtbench101_later_turns is a set of dialogues (prompts with a history): benchmarks take" in error
    error = one_line_error(capsys, "batch", "--prompts", "mt_bench+mtbench101_later_turns", "--output", tmp_path / "o")
    assert "mtbench101_later_turns is a set of dialogues (prompts with a history): load it on its own" in error


def test_the_evaluation_sets_ship_with_the_package(monkeypatch):
    from angelspec_hf.prompts import PACKAGED_DATA_DIR, local_prompt_file

    monkeypatch.delenv("ANGELSPEC_DATA_DIR")
    sizes = {"mt_bench": 80, "spec_bench": 480, "gsm8k_test": 1319, "mbpp_test": 500, "arena_hard": 500, "mixed": 240}
    for name, size in sizes.items():
        assert len(load_prompts(name)) == size, name
    for name in ("mt_bench", "spec_bench", "gsm8k_test", "mbpp_test", "arena_hard"):
        path = local_prompt_file(name)
        assert path.startswith(PACKAGED_DATA_DIR)
        source_notes = os.path.join(PACKAGED_DATA_DIR, os.path.relpath(path, PACKAGED_DATA_DIR).split(os.sep)[0])
        assert "licen" in open(os.path.join(source_notes, "SOURCE.md")).read().lower()
    assert len(load_prompts("mbpp_train")) == 464, "MBPP ships whole: its train split too"


def test_batch_refuses_a_length_beyond_the_context_before_loading(capsys, tmp_path):
    error = one_line_error(capsys, "batch", "--max-new-tokens", 1000000000, "--output", tmp_path / "out.jsonl")
    assert "--max-new-tokens 1000000000 leaves no room for a prompt in the target's context of 8192 positions" in error
    assert not (tmp_path / "out.jsonl").exists()


def test_batch_exits_non_zero_when_a_request_failed(chat_target, smollm2_tokenizer, tmp_path, monkeypatch, capsys):
    """A prompt longer than the tiny target's 512 positions fails; the others are answered; the exit status says so."""
    monkeypatch.setattr(targets, "load_target", LOAD_TARGET)
    chat_target.save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    texts = ["Say hi.", "word " * 600, "Count to three."]
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    output = tmp_path / "out.jsonl"
    argv = ["batch", "--target", tmp_path / "target", "--prompts", prompts, "--max-new-tokens", 4, "--output", output]
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in argv] + ["--linear-kernels", "default", "--concurrency", "2"])
    assert exit_info.value.code == 1
    assert "1 of 3 requests failed" in capsys.readouterr().err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [record["finish_reason"] for record in records][1] == "error" and records[0]["new_tokens"] > 0
    assert records[2]["finish_reason"] in ("eos", "length")


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_regenerate_reports_its_throughput_and_both_bounds(
    chat_target, smollm2_tokenizer, tmp_path, monkeypatch, capsys, dtype
):
    """... and with `--dtype auto` which precision decodes its batch faster here, measured, and the responses of the
    target it chose (marked `dtype` when bfloat16)."""
    monkeypatch.setattr(targets, "load_target", LOAD_TARGET)
    chat_target.save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    output = tmp_path / "responses.jsonl.gz"
    argv = ["regenerate", "--target", tmp_path / "target", "--sources", "alpaca_eval", "--limit-per-source", 3]
    argv += ["--max-new-tokens", 4, "--batch-size", 2, "--output", output, "--linear-kernels", "default"]
    main([str(arg) for arg in argv + ["--dtype", dtype]])
    printed = capsys.readouterr().out
    if dtype == "auto":
        chosen = re.search(r"--dtype auto: bfloat16 decodes 2 rows [\d.]+x as fast as float32 here: (\w+)", printed)
        records = [json.loads(line) for line in gzip.open(output, "rt")]
        assert {record.get("dtype", "float32") for record in records} == {chosen.group(1)}
    assert re.search(r"3 responses, \d+ tokens in \d+ s: [\d.]+ tokens/s", printed)
    assert re.search(r"the bound of batched decoding on this machine \(2 rows per forward\): \d+ tokens/s", printed)
    assert re.search(r"at these responses' mean attended context \(\d+ tokens\): \d+ tokens/s", printed)


def test_bench_concurrency_must_be_a_list_of_positive_integers(capsys, prompts):
    for value in ("abc", "0", "1,,4", "2,-1"):
        error = usage_error(capsys, "bench", "--prompts", prompts, "--concurrency", value)
        assert "argument --concurrency: must be comma-separated positive integers" in error


def test_bench_limits_must_be_positive(capsys, prompts):
    assert "argument --limit: must be a positive integer, got '0'" in usage_error(capsys, "bench", "--limit", "0")
    assert "argument --repeats: must be a positive integer" in usage_error(capsys, "bench", "--repeats", "0")
    assert "argument --prompt-lookup" in usage_error(capsys, "bench", "--prompt-lookup", "-1")
    error = one_line_error(capsys, "bench", "--prompts", prompts, "--concurrency", "1,16", "--limit", "4")
    assert "--limit 4 leaves too few prompts" in error and "needs 16" in error


def test_bench_schedules_are_checked(capsys, drafter):
    assert "argument --schedules" in usage_error(capsys, "bench", "--schedules", "dcut,fixed-2")
    assert "argument --schedules" in usage_error(capsys, "bench", "--schedules", "constant-x")
    assert "argument --drafter" in usage_error(capsys, "bench", "--drafter", f"{drafter}@constant-0")


def test_profile_rows_and_repeats_must_be_positive(capsys):
    assert "argument --rows: must be comma-separated positive integers" in usage_error(
        capsys, "profile", "--rows", "0"
    )
    assert "argument --rows" in usage_error(capsys, "profile", "--rows", "1,x")
    assert "argument --repeats: must be a positive integer" in usage_error(capsys, "profile", "--repeats", "0")


def test_suite_sizes_and_drafters_dir(capsys, tmp_path):
    assert "argument --repeats: must be a positive integer" in usage_error(capsys, "suite", "--repeats", "0")
    error = one_line_error(capsys, "suite", "--drafters-dir", tmp_path / "no-cards", "--output-dir", tmp_path / "out")
    assert "--drafters-dir" in error and "no such folder" in error


def test_serve_and_its_load_benchmark_check_their_arguments(capsys, tmp_path, monkeypatch):
    assert "not a port number" in one_line_error(capsys, "serve", "--port", "70000")
    assert "--request-timeout: must be a positive number" in usage_error(capsys, "serve", "--request-timeout", "0")
    error = one_line_error(capsys, "serve", "--drafter", tmp_path / "nowhere")
    assert "nowhere" in error
    assert "--rates: must be comma-separated positive numbers" in usage_error(capsys, "serve-bench", "--rates", "1,-2")
    assert "--streams" in usage_error(capsys, "serve-bench", "--streams", "0")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "uvicorn" else find_spec(name))
    assert "pip install 'angelspec_hf[serve]'" in one_line_error(capsys, "serve")
    assert "serving needs uvicorn" in one_line_error(capsys, "serve-bench")


@pytest.mark.parametrize("value", ["-1", "nan", "hot"])
def test_negative_temperature_is_an_error(capsys, tmp_path, prompts, value):
    error = usage_error(
        capsys, "batch", "--prompts", prompts, "--output", tmp_path / "o.jsonl", "--temperature", value
    )
    assert f"argument --temperature: must be a number >= 0 (0: greedy), got '{value}'" in error


def test_nonexistent_drafter_says_so(capsys, tmp_path, prompts, monkeypatch):
    output = tmp_path / "out.jsonl"
    missing = tmp_path / "no-drafter"
    error = one_line_error(capsys, "batch", "--drafter", missing, "--prompts", prompts, "--output", output)
    assert f"--drafter {missing}: no drafter folder of that name" in error
    error = one_line_error(capsys, "batch", "--drafter", "me/my-drafter", "--prompts", prompts, "--output", output)
    assert (
        "--drafter me/my-drafter: no drafter folder of that name (and it is not a Hub id available offline)" in error
    )
    with monkeypatch.context() as online:  # a bare name is no drafter's Hub id: refused before anything loads
        online.delenv("HF_HUB_OFFLINE", raising=False)
        index = ["index-outputs", "--responses", "r.jsonl.gz", "--output", tmp_path / "index"]
        for command in (["batch", "--prompts", prompts, "--output", output], index):
            error = one_line_error(capsys, *command, "--drafter", "my-drafter")
            assert error.endswith("--drafter my-drafter: no drafter folder of that name"), error
    error = one_line_error(capsys, "demo", "--drafter", "./my-drafter")
    assert "no drafter folder" in error and "Hub id" not in error
    error = one_line_error(capsys, "bench", "--drafter", f"{tmp_path / 'missing'}@dcut", "--prompts", prompts)
    assert f"--drafter {tmp_path / 'missing'}: no drafter folder" in error
    error = one_line_error(capsys, "bench", "--target", tmp_path / "no-target", "--prompts", prompts)
    assert "no target folder" in error


def test_estimate_needs_its_responses_file(capsys, tmp_path, drafter):
    error = one_line_error(capsys, "estimate", "--drafter", drafter, "--responses", tmp_path / "none.jsonl.gz")
    assert f"--responses {tmp_path / 'none.jsonl.gz'}: no such file" in error
    error = one_line_error(capsys, "estimate", "--drafter", tmp_path / "gone")
    assert "no drafter folder" in error


def test_estimate_refuses_a_drafter_without_a_training_forward_before_loading_the_target(capsys, monkeypatch):
    """The suffix drafter and the router draft without a forward over target states, which the offline estimate
    replays: refused by name from the card's config, before the target is loaded."""
    from angelspec_hf.cli import estimate

    monkeypatch.setattr(estimate, "load_target_from_args", lambda args: pytest.fail("the target was loaded"))
    for name, kind in [("smollm2-135m-instruct-suffix", "SuffixDrafter"), ("smollm2-135m-instruct-router", "Router")]:
        error = one_line_error(capsys, "estimate", "--drafter", name)
        assert f"--drafter {name}: a {kind}" in error and "angelspec bench" in error, error


def test_right_arguments_get_through_to_the_model_load(tmp_path, prompts, drafter):
    """Nothing is written while checking: the output folder does not exist until the run writes it."""
    output = tmp_path / "results" / "out.json"
    command_lines = [
        [
            "bench",
            "--drafter",
            drafter,
            "--drafter",
            f"{drafter}@constant-2,dcut,heuristic",
            "--prompts",
            prompts,
            "--schedules",
            "dcut,constant-2,heuristic",
            "--prompt-lookup",
            "3",
            "--output",
            output,
        ],
        [
            "bench",
            "--drafter",
            f"{drafter}@constant-1,dcut",
            "--prompts",
            prompts,
            "--concurrency",
            "1, 4",
            "--min-requests",
            "5",
            "--repeats",
            "2",
            "--output",
            output,
        ],
        [
            "batch",
            "--drafter",
            drafter,
            "--prompts",
            f"{prompts}+{prompts}",
            "--policy",
            "constant-2",
            "--temperature",
            "0",
            "--output",
            output,
        ],
        ["profile", "--rows", "4,1", "--repeats", "1", "--output", output],
        ["estimate", "--drafter", drafter, "--sources", "mt_bench", "--output", output],
        ["suite", "--drafters-dir", tmp_path, "--output-dir", tmp_path / "results" / "suite"],
    ]
    for argv in command_lines:
        with pytest.raises(AssertionError, match="a model was loaded"):
            main([str(arg) for arg in argv])
    assert not (tmp_path / "results").exists()


def test_prompt_files_keep_their_formats(tmp_path):
    lines = tmp_path / "mixed.jsonl"
    lines.write_text(
        "\ufeff"
        + json.dumps({"prompt": "Say hi.", "category": "chat"})
        + "\n\n"
        + json.dumps({"turns": ["Name a colour.", "Why?"]})
        + "\r\n"
        + json.dumps({"prompt": None, "turns": ["Count."]})
        + "\n"
    )
    rows = load_prompts(str(lines))
    assert rows["prompt"] == ["Say hi.", "Name a colour.", "Count."]
    assert rows["category"] == ["chat", "mixed.jsonl", "mixed.jsonl"]
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"prompt": "One."}, {"turns": ["Two."]}], indent=1))
    assert load_prompts(str(array), limit=1)["prompt"] == ["One."]


def test_a_prompt_set_narrows_to_one_of_its_categories():
    rows = load_prompts("spec_bench:summarization")
    assert len(rows) == 80 and set(rows["category"]) == {"summarization"}
    with pytest.raises(ValueError, match="no category 'poetry'.*rag"):
        load_prompts("spec_bench:poetry")


def test_version_and_defaults_in_help(capsys):
    from angelspec_hf import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"angelspec {__version__}"
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "(default: smollm2)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["bench", "--help"],
        ["suite", "--help"],
        ["bench", "--bogus"],
        ["batch", "--policy", "x"],
    ],
)
def test_help_version_and_bad_flags_import_neither_torch_nor_transformers(argv):
    """What makes `angelspec --help` answer at once, and a wrong flag or policy label be refused at once: the
    package and its parser (verify-policy labels included) import no heavy module."""
    code = (
        "import sys\n"
        "from angelspec_hf.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(name for name in ('torch', 'transformers', 'datasets', 'evaluate') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "[]"


def test_a_shipped_drafter_is_taken_by_name():
    """`--drafter smollm2-135m-instruct-mtp` (a shipped card's name) passes the checks and reaches the load."""
    with pytest.raises(AssertionError, match="a model was loaded"):
        main(["demo", "--drafter", "smollm2-135m-instruct-mtp"])


def test_target_dtype_and_device_are_checked_then_passed_to_the_load(capsys, monkeypatch, prompts):
    assert "invalid choice: 'float64'" in usage_error(capsys, "profile", "--dtype", "float64")
    assert one_line_error(capsys, "profile", "--device", "nosuch").startswith("angelspec profile: error: --device")
    seen = {}

    def record(name, **options):
        seen.update(options, name=name)
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(targets, "load_target", record)
    with pytest.raises(AssertionError, match="a model was loaded"):
        main(["bench", "--prompts", str(prompts), "--dtype", "bfloat16", "--device", "cpu"])
    assert seen == {"name": "smollm2", "dtype": "bfloat16", "device": "cpu", "tune_kernels": True}
    with pytest.raises(AssertionError, match="a model was loaded"):
        main(["bench", "--prompts", str(prompts), "--linear-kernels", "default"])
    assert seen["tune_kernels"] is False
