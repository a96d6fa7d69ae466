"""Prompt sets for training and benchmarking, read with `datasets` from a local folder or the Hub.

Every set has a name (`mt_bench`, `gsm8k_test`, ...), the file it lives in under the local data folder
(default `../shared/data` when it exists), and the Hub data set a user elsewhere would load instead. Each record
becomes `{"prompt": str, "category": str}`: the first user turn.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import datasets

DATA_DIR_ENV = "ANGELSPEC_DATA_DIR"


@dataclass(frozen=True)
class PromptSet:
    local_file: str
    hub_id: str
    hub_config: str | None
    hub_split: str
    to_prompt: Callable[[dict], str]
    category: Callable[[dict], str] = lambda record: ""
    keep: Callable[[dict], bool] = lambda record: True


def _first_turn(record: dict) -> str:
    return record["turns"][0]


def _instruction_with_input(record: dict) -> str:
    extra = record.get("input") or ""
    if not extra and record.get("instances"):
        extra = record["instances"][0].get("input") or ""
    return f"{record['instruction']}\n\n{extra}" if extra else record["instruction"]


def _mbpp_prompt(record: dict) -> str:
    tests = "\n".join(record["test_list"])
    return f"{record['text']}\nYour code should pass these tests:\n{tests}"


PROMPT_SETS: dict[str, PromptSet] = {
    "mt_bench": PromptSet(
        "mt_bench/question.jsonl", "HuggingFaceH4/mt_bench_prompts", None, "train", _first_turn,
        category=lambda r: r["category"],
    ),
    "spec_bench": PromptSet(
        "spec_bench/question.jsonl", "hemingkx/Spec-Bench", None, "test", _first_turn,
        category=lambda r: r["category"],
    ),
    "alpaca_eval": PromptSet(
        "alpaca_eval/model_outputs.json", "tatsu-lab/alpaca_eval", "alpaca_eval", "eval",
        lambda r: r["instruction"], category=lambda r: r.get("dataset", ""),
    ),
    "arena_hard": PromptSet(
        "arena_hard/arena-hard-v0.1/question.jsonl", "lmarena-ai/arena-hard-auto", None, "train",
        lambda r: r["prompt"] if "prompt" in r else r["turns"][0]["content"],
    ),
    "self_instruct": PromptSet(
        "self_instruct/user_oriented_instructions.jsonl", "yizhongw/self_instruct", "human_eval", "train",
        _instruction_with_input,
    ),
    "self_instruct_seed": PromptSet(
        "self_instruct/seed_tasks.jsonl", "yizhongw/self_instruct", "super_natural_instructions", "train",
        _instruction_with_input,
    ),
    "code_alpaca": PromptSet(
        "code_alpaca/code_alpaca_2k.json", "sahil2801/CodeAlpaca-20k", None, "train", _instruction_with_input,
    ),
    "gsm8k_train": PromptSet("gsm8k/train.jsonl", "openai/gsm8k", "main", "train", lambda r: r["question"]),
    "gsm8k_test": PromptSet("gsm8k/test.jsonl", "openai/gsm8k", "main", "test", lambda r: r["question"]),
    # MBPP's own split by task id: 11-510 test, 511-974 train.
    "mbpp_test": PromptSet(
        "mbpp/mbpp.jsonl", "google-research-datasets/mbpp", "full", "test", _mbpp_prompt,
        keep=lambda r: 11 <= r["task_id"] <= 510,
    ),
    "mbpp_train": PromptSet(
        "mbpp/mbpp.jsonl", "google-research-datasets/mbpp", "full", "train", _mbpp_prompt,
        keep=lambda r: 511 <= r["task_id"] <= 974,
    ),
}


# Named mixtures: chat, math and code prompts in turn (the engine benchmark's serving mix).
MIXTURES = {"mixed": "mt_bench+gsm8k_test+mbpp_test"}


def default_data_dir() -> str | None:
    """`$ANGELSPEC_DATA_DIR`, else `../shared/data` beside the working directory or the package, if it exists."""
    candidates = [os.environ.get(DATA_DIR_ENV)]
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidates += [os.path.join(os.getcwd(), "..", "shared", "data"), os.path.join(package_root, "..", "shared", "data")]
    for candidate in candidates:
        if candidate and os.path.isdir(candidate):
            return os.path.abspath(candidate)
    return None


def load_prompts(source: str, data_dir: str | None = None, limit: int | None = None) -> datasets.Dataset:
    """Load prompts as a `datasets.Dataset` with columns `prompt` and `category`.

    `source` is a registered set name (read from `data_dir`, else from the Hub), a path to a JSON/JSONL file
    whose records carry `prompt` (a string) or `turns` (a list of strings, MT-bench / Spec-Bench format), or
    several of these joined by `+` (taken in turn, e.g. `mt_bench+gsm8k_test+mbpp_test`; `mixed` names that one).
    """
    source = MIXTURES.get(source, source)
    if "+" in source:
        parts = [load_prompts(part, data_dir=data_dir) for part in source.split("+")]
        prompts = datasets.interleave_datasets(parts)  # round robin until the shortest part runs out
    elif source in PROMPT_SETS:
        spec = PROMPT_SETS[source]
        data_dir = data_dir or default_data_dir()
        if data_dir is not None and os.path.isfile(os.path.join(data_dir, spec.local_file)):
            raw = datasets.load_dataset("json", data_files=os.path.join(data_dir, spec.local_file), split="train")
        else:
            raw = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.hub_split)
        raw = raw.filter(spec.keep)
        prompts = raw.map(
            lambda r: {"prompt": spec.to_prompt(r), "category": spec.category(r) or source},
            remove_columns=raw.column_names,
        )
    elif os.path.isfile(source):
        raw = datasets.load_dataset("json", data_files=source, split="train")
        if "prompt" not in raw.column_names and "turns" not in raw.column_names:
            raise ValueError(f"{source}: each record needs a `prompt` string or a `turns` list; found {raw.column_names}")

        def to_record(r):
            prompt = r["prompt"] if r.get("prompt") is not None else r["turns"][0]
            return {"prompt": prompt, "category": r.get("category") or os.path.basename(source)}

        prompts = raw.map(to_record, remove_columns=raw.column_names)
    else:
        known = ", ".join(sorted(PROMPT_SETS) + sorted(MIXTURES))
        raise FileNotFoundError(f"Unknown prompt source {source!r}: not a file and not one of {known}")
    if limit is not None:
        prompts = prompts.select(range(min(limit, len(prompts))))
    return prompts


def encode_chat(tokenizer, prompt: str) -> list[int]:
    """Token ids of `prompt` as the first user turn of the tokenizer's chat template, ready for generation."""
    if not prompt.strip():
        raise ValueError("Empty prompt: there is nothing to condition the generation on.")
    messages = [{"role": "user", "content": prompt}]
    if tokenizer.chat_template is None:
        return tokenizer(prompt)["input_ids"]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
