"""Prompt sets for training and benchmarking, read with `datasets` from a local folder, the package or the Hub.

Every set has a name (`mt_bench`, `gsm8k_test`, ...), the file it lives in under a data folder, and the Hub data set
a user elsewhere would load instead. A set is read from the first of: the `--data-dir` folder (or
`$ANGELSPEC_DATA_DIR`), the copy shipped in the package (the evaluation sets the commands default to: MT-bench,
Spec-Bench, Arena-Hard, GSM8K test, MBPP; `angelspec_hf/data/prompts`, licence and source in a `SOURCE.md` each),
the Hub. Each record becomes `{"prompt": str, "category": str}`: the first user turn; a multi-turn set (`turns`)
makes one row per later user turn instead, with the dialogue's earlier messages as its `history`. A prompt file of
one's own (JSON lines) is read and checked record by record here (`read_prompt_file`), so a malformed one is
reported by line before any model loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable


if TYPE_CHECKING:
    import datasets

DATA_DIR_ENV = "ANGELSPEC_DATA_DIR"


@dataclass(frozen=True)
class PromptSet:
    local_file: str
    hub_id: str | None  # None: only a local copy exists (under --data-dir)
    hub_config: str | None
    hub_split: str
    to_prompt: Callable[[dict], str] | None  # None for a set of dialogues (`turns`)
    category: Callable[[dict], str] = lambda record: ""
    keep: Callable[[dict], bool] = lambda record: True
    reference: Callable[[dict], str] | None = None  # the set's own answer to the prompt, where it has one
    # A set of dialogues: the rows `{"prompt", "history"}` one record makes, `history` the chat messages before it.
    turns: Callable[[dict], list[dict]] | None = None


def _first_turn(record: dict) -> str:
    return record["turns"][0]


def _instruction_with_input(record: dict) -> str:
    extra = record.get("input") or ""
    if not extra and record.get("instances"):
        extra = record["instances"][0].get("input") or ""
    return f"{record['instruction']}\n\n{extra}" if extra else record["instruction"]


def _first_instance_output(record: dict) -> str:
    return record["instances"][0]["output"] if record.get("instances") else ""


def _mtbench101_later_turns(record: dict) -> list[dict]:
    """Every user turn of an MT-Bench-101 dialogue after the first, after the dialogue's own earlier turns (its
    recorded answers, not the target's: each turn is then a prompt of its own, made without decoding the ones before)."""
    rows, history = [], []
    for turn in record["history"]:
        if history:
            rows.append({"prompt": turn["user"], "history": list(history)})
        history += [{"role": "user", "content": turn["user"]}, {"role": "assistant", "content": turn["bot"]}]
    return rows


def _mbpp_prompt(record: dict) -> str:
    tests = "\n".join(record["test_list"])
    return f"{record['text']}\nYour code should pass these tests:\n{tests}"


PROMPT_SETS: dict[str, PromptSet] = {
    "mt_bench": PromptSet(
        "mt_bench/question.jsonl",
        "HuggingFaceH4/mt_bench_prompts",
        None,
        "train",
        _first_turn,
        category=lambda r: r["category"],
    ),
    "spec_bench": PromptSet(
        "spec_bench/question.jsonl",
        "hemingkx/Spec-Bench",
        None,
        "test",
        _first_turn,
        category=lambda r: r["category"],
    ),
    "alpaca_eval": PromptSet(
        "alpaca_eval/model_outputs.json",
        "tatsu-lab/alpaca_eval",
        "alpaca_eval",
        "eval",
        lambda r: r["instruction"],
        category=lambda r: r.get("dataset", ""),
        reference=lambda r: r["output"],
    ),
    "arena_hard": PromptSet(
        "arena_hard/arena-hard-v0.1/question.jsonl",
        "lmarena-ai/arena-hard-auto",
        None,
        "train",
        lambda r: r["prompt"] if "prompt" in r else r["turns"][0]["content"],
    ),
    "self_instruct": PromptSet(
        "self_instruct/user_oriented_instructions.jsonl",
        "yizhongw/self_instruct",
        "human_eval",
        "train",
        _instruction_with_input,
        reference=_first_instance_output,
    ),
    "self_instruct_seed": PromptSet(
        "self_instruct/seed_tasks.jsonl",
        "yizhongw/self_instruct",
        "super_natural_instructions",
        "train",
        _instruction_with_input,
        reference=_first_instance_output,
    ),
    # No Hub data set is known to carry this file (it is in opencompass' git history): read from --data-dir only.
    "mtbench101": PromptSet(
        "mtbench101/mtbench101.jsonl",
        None,
        None,
        "train",
        lambda r: r["history"][0]["user"],
        category=lambda r: r["task"],
        reference=lambda r: r["history"][0]["bot"],
    ),
    # The same dialogues' later turns (2,820), each with the turns before it.
    "mtbench101_later_turns": PromptSet(
        "mtbench101/mtbench101.jsonl",
        None,
        None,
        "train",
        None,
        category=lambda r: r["task"],
        turns=_mtbench101_later_turns,
    ),
    "code_alpaca": PromptSet(
        "code_alpaca/code_alpaca_2k.json",
        "sahil2801/CodeAlpaca-20k",
        None,
        "train",
        _instruction_with_input,
        reference=lambda r: r["output"],
    ),
    # Code Alpaca's newer release (4,535 code instructions); its repository's file, read from --data-dir only.
    "code_alpaca_new": PromptSet(
        "code_alpaca_new/new_codealpaca.json",
        None,
        None,
        "train",
        _instruction_with_input,
        reference=lambda r: r["output"],
    ),
    "gsm8k_train": PromptSet(
        "gsm8k/train.jsonl", "openai/gsm8k", "main", "train", lambda r: r["question"], reference=lambda r: r["answer"]
    ),
    "gsm8k_test": PromptSet("gsm8k/test.jsonl", "openai/gsm8k", "main", "test", lambda r: r["question"]),
    # MBPP's own split by task id: 11-510 test, 511-974 train.
    "mbpp_test": PromptSet(
        "mbpp/mbpp.jsonl",
        "google-research-datasets/mbpp",
        "full",
        "test",
        _mbpp_prompt,
        keep=lambda r: 11 <= r["task_id"] <= 510,
    ),
    "mbpp_train": PromptSet(
        "mbpp/mbpp.jsonl",
        "google-research-datasets/mbpp",
        "full",
        "train",
        _mbpp_prompt,
        keep=lambda r: 511 <= r["task_id"] <= 974,
        reference=lambda r: r["code"],
    ),
}


# Named mixtures, prompts in turn: chat, math and code (the engine benchmark's serving mix); chat and code (the
# server's load benchmark).
MIXTURES = {"mixed": "mt_bench+gsm8k_test+mbpp_test", "chat_code": "mt_bench+mbpp_test"}


PACKAGED_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prompts")


def default_data_dir() -> str | None:
    """`$ANGELSPEC_DATA_DIR` when it names a folder. (Nothing beside the checkout is looked at: a user has none.)"""
    folder = os.environ.get(DATA_DIR_ENV)
    return os.path.abspath(folder) if folder and os.path.isdir(folder) else None


def local_prompt_file(name: str, data_dir: str | None = None) -> str | None:
    """The file prompt set `name` is read from: under `data_dir` (default `default_data_dir()`), else the package's
    own copy; None when neither holds it (then it comes from the Hub)."""
    spec = PROMPT_SETS[name]
    for folder in (data_dir or default_data_dir(), PACKAGED_DATA_DIR):
        if folder and os.path.isfile(os.path.join(folder, spec.local_file)):
            return os.path.join(folder, spec.local_file)
    return None


def check_prompt_set_available(name: str, data_dir: str | None = None) -> None:
    """Raise FileNotFoundError, in one line naming what to pass, unless prompt set `name` can be read: a local or
    shipped file, or its Hub data set (online, or offline with the data set in the local `datasets` cache)."""
    if local_prompt_file(name, data_dir) is not None:
        return
    spec = PROMPT_SETS[name]
    where = f"no --data-dir (or ${DATA_DIR_ENV}) holds {spec.local_file}"
    if spec.hub_id is None:
        raise FileNotFoundError(f"Prompt set {name!r} is not shipped with the package and {where}")
    if _hub_offline() and not _in_datasets_cache(spec.hub_id):
        raise FileNotFoundError(
            f"Prompt set {name!r} is not shipped with the package, {where}, and the Hub is offline "
            f"(HF_HUB_OFFLINE) with no cached copy of {spec.hub_id}: pass --data-dir"
        )


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _in_datasets_cache(hub_id: str) -> bool:
    """Whether `datasets` has prepared Hub data set `hub_id` before (its cache folder `owner___name` exists)."""
    from datasets import config

    return os.path.isdir(os.path.join(str(config.HF_DATASETS_CACHE), hub_id.replace("/", "___")))


def source_parts(source: str) -> list[str]:
    """The prompt sets and files `source` names: a file, a set, a named mixture or parts joined by `+`."""
    if os.path.isfile(source):
        return [source]
    return MIXTURES.get(source, source).split("+")


def check_prompt_source(source: str, data_dir: str | None = None) -> None:
    """Raise ValueError unless every part of `source` is a known prompt set or a well-formed prompt file, and
    FileNotFoundError when a set can be read from nowhere (`check_prompt_set_available`)."""
    parts = source_parts(source)
    if len(parts) > 1:
        _refuse_dialogues(parts, "load it on its own")
    for part in parts:
        if os.path.isfile(part):
            read_prompt_file(part)
        elif part.partition(":")[0] not in PROMPT_SETS:
            raise ValueError(_unknown_source_message(part))
        else:
            check_prompt_set_available(part.partition(":")[0], data_dir)


def _unknown_source_message(source: str) -> str:
    if source.endswith((".json", ".jsonl")) or os.sep in source:
        return f"{source}: no such prompt file"
    known = ", ".join(sorted(PROMPT_SETS) + sorted(MIXTURES))
    return f"Unknown prompt source {source!r}: not a file and not one of {known}"


def read_prompt_file(path: str) -> list[dict]:
    """The records of a JSON-lines file (or a JSON array) as `{"prompt": str, "category": str}`.

    A record carries `prompt` (a non-empty string) or `turns` (a list of strings, MT-bench / Spec-Bench format, the
    first one used), and optionally `category`. The whole file is checked: a ValueError names the line (or array
    item) of the first bad record.
    """
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{path} line {line}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})"
        ) from None
    if text.lstrip().startswith("["):
        try:
            records = [(f"item {index}", record) for index, record in enumerate(json.loads(text), start=1)]
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {error.lineno}: {_not_json(error)}") from None
    else:
        records = []
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number}: {_not_json(error)}") from None
    if not records:
        raise ValueError(f"{path} is empty: no prompt records")
    return [_prompt_record(record, f"{path} {where}", os.path.basename(path)) for where, record in records]


def _not_json(error: json.JSONDecodeError) -> str:
    return f"not valid JSON ({error.msg} at column {error.colno})"


def _prompt_record(record, where: str, default_category: str) -> dict:
    """`{"prompt", "category"}` of one record of a prompt file; ValueError (prefixed with `where`) if malformed."""
    if not isinstance(record, dict):
        raise ValueError(f'{where}: a record must be a JSON object with "prompt" or "turns", got {_shown(record)}')
    if record.get("prompt") is None and record.get("turns") is not None:
        turns = record["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(turn, str) for turn in turns)):
            raise ValueError(f'{where}: "turns" must be a non-empty list of strings, got {_shown(turns)}')
        if not turns[0].strip():
            raise ValueError(f'{where}: the first of "turns" must be a non-empty string, got {_shown(turns[0])}')
        prompt = turns[0]
    elif "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f'{where}: "prompt" must be a non-empty string, got {_shown(prompt)}')
    else:
        keys = ", ".join(f'"{key}"' for key in record) or "none"
        raise ValueError(f'{where}: a record needs a "prompt" string or a "turns" list; its keys: {keys}')
    return {"prompt": prompt, "category": str(record.get("category") or default_category)}


def _shown(value, width: int = 40) -> str:
    """`value` as JSON, cut to `width` characters, for an error message."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 3] + "..."


def load_prompts(source: str, data_dir: str | None = None, limit: int | None = None) -> datasets.Dataset:
    """Load prompts as a `datasets.Dataset` with columns `prompt` and `category`.

    `source` is a registered set name (read from `data_dir`, else from the Hub), optionally narrowed to one of its
    categories (`spec_bench:summarization`), a path to a JSON/JSONL file (see `read_prompt_file`), or several of
    these joined by `+` (taken in turn, e.g. `mt_bench+gsm8k_test+mbpp_test`; `mixed` names that one).
    """
    import datasets

    parts = source_parts(source)
    if len(parts) > 1:
        _refuse_dialogues(parts, "load it on its own")  # rows with and without a history make no one Dataset
        prompts = datasets.interleave_datasets(  # round robin until the shortest part runs out
            [load_prompts(part, data_dir=data_dir) for part in parts]
        )
    elif os.path.isfile(source):
        prompts = datasets.Dataset.from_list(read_prompt_file(source))
    elif source.partition(":")[0] in PROMPT_SETS:
        name, _, category = source.partition(":")
        spec = PROMPT_SETS[name]
        raw = _load_set(name, data_dir)
        if spec.turns is None:
            prompts = raw.map(
                lambda r: {"prompt": spec.to_prompt(r), "category": spec.category(r) or name},
                remove_columns=raw.column_names,
            )
        else:
            prompts = datasets.Dataset.from_list(
                [{**row, "category": spec.category(record) or name} for record in raw for row in spec.turns(record)]
            )
        if category:
            known = sorted(set(prompts["category"]))
            if category not in known:
                raise ValueError(f"Prompt set {name!r} has no category {category!r}; it has {', '.join(known)}")
            prompts = prompts.filter(lambda r: r["category"] == category)
    else:
        raise FileNotFoundError(_unknown_source_message(source))
    if limit is not None:
        prompts = prompts.select(range(min(limit, len(prompts))))
    return prompts


def _is_multi_turn(source: str) -> bool:
    spec = PROMPT_SETS.get(source.partition(":")[0])
    return spec is not None and spec.turns is not None


def _refuse_dialogues(parts: list[str], why: str) -> None:
    """Raise ValueError, ending in `why`, if one of `parts` is a set of dialogues."""
    for part in parts:
        if _is_multi_turn(part):
            raise ValueError(f"{part} is a set of dialogues (prompts with a history): {why}")


def check_single_turn(source: str) -> None:
    """Raise ValueError if `source` holds multi-turn prompts, for a consumer that reads the `prompt` column alone."""
    _refuse_dialogues(
        source_parts(source), "benchmarks take single-turn prompts; regenerate and batch read the history"
    )


def _load_set(source: str, data_dir: str | None) -> datasets.Dataset:
    """The records of prompt set `source` that it keeps, from a local data folder, the package or the Hub."""
    import datasets

    spec = PROMPT_SETS[source]
    check_prompt_set_available(source, data_dir)
    path = local_prompt_file(source, data_dir)
    if path is not None:
        raw = datasets.load_dataset("json", data_files=path, split="train")
    else:
        raw = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.hub_split)
    return raw.filter(spec.keep)


def prompts_of(sources: list[str], data_dir: str | None = None) -> set[str]:
    """Every prompt of `sources`, whitespace- and case-normalised (`normalize_prompt`): a set to leave out, e.g. the
    evaluation sets' prompts from training data or a drafter's datastore."""
    return {normalize_prompt(row["prompt"]) for source in sources for row in load_prompts(source, data_dir=data_dir)}


def normalize_prompt(prompt: str) -> str:
    return " ".join(prompt.lower().split())


def load_references(source: str, data_dir: str | None = None, limit: int | None = None) -> list[dict]:
    """`{"prompt", "reference"}` of every record of prompt set `source` with a non-empty answer of its own (the
    sets with answers: see `PromptSet.reference`)."""
    spec = PROMPT_SETS.get(source)
    if spec is None or spec.reference is None:
        with_answers = ", ".join(name for name, candidate in PROMPT_SETS.items() if candidate.reference is not None)
        raise ValueError(f"Prompt set {source!r} has no reference answers; these do: {with_answers}")
    rows = [{"prompt": spec.to_prompt(r), "reference": spec.reference(r)} for r in _load_set(source, data_dir)]
    rows = [row for row in rows if row["prompt"].strip() and row["reference"].strip()]
    return rows[:limit] if limit is not None else rows


def encode_chat(tokenizer, prompt: str, history: list[dict] | None = None) -> list[int]:
    """Token ids of `prompt` as a user turn of the tokenizer's chat template, after the chat messages `history` (none:
    the first turn), ready for generation."""
    if not prompt.strip():
        raise ValueError("Empty prompt: there is nothing to condition the generation on.")
    messages = [*(history or []), {"role": "user", "content": prompt}]
    if tokenizer.chat_template is None:
        return tokenizer("\n\n".join(message["content"] for message in messages))["input_ids"]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
