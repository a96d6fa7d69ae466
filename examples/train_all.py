"""One command on one device: fresh target data, then MTP, DFly and its DFlash ablation trained, scored offline and
saved as cards: issue 36's one-shot run for a lent GPU.

    python examples/train_all.py --device cuda --minutes 8 --data-dir prompts/ --output $OUT/train-all
    python examples/train_all.py --target tiny/ --minutes 1 --recipe mtp=examples/configs/tiny_mtp.yaml ...  # CPU test

Every phase runs to a wall-clock deadline and leaves what it made, so a run cut short brings back the phases it
finished: responses are appended as each finishes, a drafter is saved when its budget ends.
1. regenerate (`--regenerate-share` of the time, half per domain): the target answers the chat and the code/math
   prompt sets on the batched engine, greedy first, then sampled passes with new seeds until the deadline;
2. train each recipe for an equal share with `examples/train_drafter.py` (its Trainer, YAML and overrides): MTP on
   the chat responses, DFly and DFlash on the code/math ones (plus committed files: --chat-responses, --code-responses);
3. score each on the held-out responses (offline τ: MT-bench + Arena-Hard for MTP, GSM8K + MBPP for DFly and DFlash)
   and save it in fp16 under `cards/<recipe>/`, with `summary.json` (τ, tokens, minutes, the command) beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass


os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import train_drafter  # noqa: E402

from angelspec_hf import load_drafter, load_target  # noqa: E402
from angelspec_hf.cli.estimate import DEFAULT_HELDOUT  # noqa: E402
from angelspec_hf.prompts import check_prompt_source  # noqa: E402
from angelspec_hf.training import estimate_on_responses  # noqa: E402
from angelspec_hf.training.regenerate import read_responses, regenerate_responses  # noqa: E402


CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
EVALUATION_SETS = "mt_bench,spec_bench,arena_hard,gsm8k_test,mbpp_test"


@dataclass(frozen=True)
class Domain:
    sources: str  # prompt sets the target answers
    heldout_sources: str  # the held-out responses a drafter of this domain is scored on


DOMAINS = {
    "chat": Domain("alpaca_eval,self_instruct,self_instruct_seed,mtbench101", "mt_bench,arena_hard"),
    "code": Domain("gsm8k_train,mbpp_train,code_alpaca,code_alpaca_new", "gsm8k_test,mbpp_test"),
}
RECIPES = {  # name: (default config, domain)
    "mtp": ("gpu_mtp.yaml", "chat"),
    "dfly": ("gpu_dfly.yaml", "code"),
    "dflash": ("gpu_dflash.yaml", "code"),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="the target's dtype (default: bfloat16 on a GPU, else float32)")
    parser.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the whole run")
    parser.add_argument("--output", required=True, help="folder for data/, runs/, cards/ and summary.json")
    parser.add_argument("--data-dir", default=None, help="folder holding the training prompt sets")
    parser.add_argument("--regenerate-share", type=float, default=0.4, help="share of --minutes for new data")
    parser.add_argument("--batch-size", type=int, default=256, help="requests decoded together while regenerating")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--limit-per-source", type=int, default=None)
    parser.add_argument("--chat-responses", default="", help="existing chat responses to train on as well")
    parser.add_argument("--code-responses", default="", help="existing code/math responses to train on as well")
    parser.add_argument("--heldout", default=DEFAULT_HELDOUT, help="held-out target responses for the offline τ")
    parser.add_argument(
        "--recipe",
        action="append",
        default=[],
        help="NAME=CONFIG.yaml: train this config for a recipe (mtp, dfly, "
        "dflash); only the recipes named run when any is given",
    )
    parser.add_argument("--train-args", default="", help="more `--field value` overrides for every recipe")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    recipes = dict(item.split("=", 1) for item in args.recipe) if args.recipe else {}
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        parser.error(f"--recipe: unknown recipe {', '.join(unknown)}; the recipes are {', '.join(RECIPES)}")
    args.recipes = recipes or {name: os.path.join(CONFIGS, config) for name, (config, _) in RECIPES.items()}
    for path in list(args.recipes.values()) + [args.heldout]:
        if not os.path.isfile(path):
            parser.error(f"{path}: no such file")
    for name in args.recipes:  # every prompt set the run reads, checked before the target loads
        try:
            check_prompt_source(DOMAINS[RECIPES[name][1]].sources.replace(",", "+"), args.data_dir)
        except (OSError, ValueError) as error:
            parser.error(str(error))
    return args


def regenerate(args, target, domain: str, deadline: float) -> str:
    """The target's responses to `domain`'s prompt sets until `deadline`: greedy, then sampled passes (T=0.8)."""
    path = os.path.join(args.output, "data", f"{domain}.jsonl.gz")
    common = dict(
        data_dir=args.data_dir,
        limit_per_source=args.limit_per_source,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        exclude=EVALUATION_SETS.split(","),
        deadline=deadline,
    )
    sources = DOMAINS[domain].sources.split(",")
    passes = [{}] + [{"temperature": 0.8, "seed": 1000 * k} for k in range(1, 1000)]
    for sampling in passes:
        if time.monotonic() >= deadline:
            break
        regenerate_responses(target.model, target.tokenizer, sources, path, **common, **sampling)
    return path


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    os.makedirs(args.output, exist_ok=True)
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    summary = {"command": shlex.join(["python", "examples/train_all.py", *argv]), "device": args.device, "phases": {}}

    # 1. Data: half the regeneration time per domain the recipes need.
    domains = sorted({RECIPES[name][1] for name in args.recipes})
    regenerate_seconds = 60 * args.minutes * args.regenerate_share
    responses = {}
    for index, domain in enumerate(domains):
        phase_start = time.monotonic()
        own = regenerate(args, target, domain, phase_start + regenerate_seconds / (len(domains) - index))
        regenerate_seconds -= time.monotonic() - phase_start
        records = read_responses(own)
        extra = args.chat_responses if domain == "chat" else args.code_responses
        responses[domain] = ",".join(filter(None, [own, extra]))
        summary["phases"][f"regenerate_{domain}"] = {
            "responses": len(records),
            "tokens": sum(len(record["response_ids"]) for record in records),
            "minutes": round((time.monotonic() - phase_start) / 60, 2),
        }
    del target  # each recipe's trainer loads its own, on the training device

    # 2-3. Each recipe: an equal share of what is left, then its offline τ and an fp16 card.
    for index, (name, config) in enumerate(args.recipes.items()):
        phase_start = time.monotonic()
        share = (deadline - phase_start) / (len(args.recipes) - index)
        domain = DOMAINS[RECIPES[name][1]]
        run_dir = os.path.join(args.output, "runs", name)
        train_drafter.main(
            ["--config", config, "--target", args.target, "--target_dtype", args.dtype]
            + ["--responses", responses[RECIPES[name][1]], "--output_dir", run_dir]
            + ["--eval_responses", args.heldout, "--eval_response_sources", domain.heldout_sources]
            + ["--hidden_cache_dir", os.path.join(args.output, "cache")]
            # training gets the share less a fifth, kept for loading, the final evaluation and scoring
            + ["--max_wall_minutes", f"{0.8 * share / 60:.3f}", "--max_cpu_minutes", "100000"]
            + shlex.split(args.train_args)
        )
        summary["phases"][name] = score_and_save(args, name, run_dir, domain)
        summary["phases"][name]["minutes"] = round((time.monotonic() - phase_start) / 60, 2)
        write_summary(args.output, summary)
    summary["minutes"] = round((time.monotonic() - start) / 60, 2)
    write_summary(args.output, summary)
    return summary


def score_and_save(args, name: str, run_dir: str, domain: Domain) -> dict:
    """Offline τ of the drafter in `run_dir` on the held-out responses of its domain; saved in fp16 as a card."""
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = load_drafter(run_dir, target.model, target.tokenizer).to(args.device)
    metrics = estimate_on_responses(
        drafter,
        target.model,
        args.heldout,
        domain.heldout_sources.split(","),
        hidden_cache_dir=os.path.join(args.output, "cache"),
    )
    with open(os.path.join(run_dir, "trainer_state.json")) as handle:
        state = json.load(handle)
    card = os.path.join(args.output, "cards", name)
    drafter.to(torch.float16).save_pretrained(card)
    result = {
        "offline_tau": round(metrics["tau"], 4),
        "heldout_sources": domain.heldout_sources,
        "steps": state["global_step"],
        "tokens_seen": state.get("num_input_tokens_seen"),
        "card": card,
    }
    with open(os.path.join(card, "README.md"), "w") as handle:
        handle.write(
            f"# {name}: trained by examples/train_all.py on {args.device}\n\n"
            f"Offline τ {result['offline_tau']:.3f} on the held-out {domain.heldout_sources} responses, after "
            f"{result['steps']} steps ({result['tokens_seen']} tokens read). Summary and command: `summary.json`.\n"
        )
    return result


def write_summary(output: str, summary: dict) -> None:
    path = os.path.join(output, "summary.json")
    with open(f"{path}.tmp", "w") as handle:
        json.dump(summary, handle, indent=1)
    os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
