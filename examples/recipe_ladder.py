"""Recipe ladder: train one drafter per recipe for the same compute budget and rank them by offline τ.

    python examples/recipe_ladder.py --config examples/configs/smollm2_mtp_ladder.yaml --output runs/ladder-mtp
    python examples/recipe_ladder.py --config examples/configs/smollm2_dfly_ladder.yaml --output runs/ladder-dfly

Each rung is `examples/train_drafter.py --config CONFIG` plus its overrides, run on one thread (`--parallel` rungs at
a time, one per core) for the config's `max_cpu_minutes` (CPU time, so rungs sharing the cores get the same
compute); its score is the Trainer's final evaluation, the offline acceptance estimate on the config's held-out
responses. A rung with a result is not run again; one that was interrupted is run again from the start (a resumed
rung would get more than the budget), so the ladder can be stopped, or run in parts with `--rungs`, losing at most
the rungs in progress. The table of every rung with a result goes to `OUTPUT/ladder.md` and `OUTPUT/ladder.json`.
Compute the hidden-state caches the rungs read first (`--prepare`), so no rung waits for them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import yaml


HERE = os.path.dirname(os.path.abspath(__file__))

# One change from the config per rung (the config is the random-init baseline).
RUNGS = {
    "mtp": {
        "baseline": [],
        "warm_start": ["--warm_start", "true"],
        "zero_output_projections": ["--zero_output_projections", "true"],
        "warm_start+zero_output": ["--warm_start", "true", "--zero_output_projections", "true"],
        "taps_low_mid_high": ["--target_layer_ids", "1", "14", "26"],
        "draft_vocab_4k": ["--draft_vocab_size", "4096"],
        "draft_vocab_16k": ["--draft_vocab_size", "16384"],
        "feature_regression": ["--hidden_regression_weight", "0.1"],
        "feature_noise": ["--hidden_noise_std", "0.2"],
        "lr_3e-3": ["--learning_rate", "0.003"],
        "batch_4": ["--gradient_accumulation_steps", "4", "--learning_rate", "0.0016"],
        "depth_weights_decay": ["--depth_loss_weights", "0.5", "0.3", "0.2"],
        # Data source at a similar size (the regenerated file has 1,204 responses, ~170 k response tokens): the
        # prompt sets' own answers read teacher-forced (TF_CHAT), and both together.
        "data_teacher_forced": ["--responses", "runs/data/tf_chat.jsonl.gz"],
        "data_mixed": ["--responses", "data/smollm2-135m-instruct/chat_responses.jsonl.gz,runs/data/tf_chat.jsonl.gz"],
    },
    "dfly": {
        "baseline": [],
        "warm_start": ["--warm_start", "true"],
        "zero_output_projections": ["--zero_output_projections", "true"],
        "draft_vocab_4k": ["--draft_vocab_size", "4096"],
        "draft_vocab_16k": ["--draft_vocab_size", "16384"],
        "lr_3e-3": ["--learning_rate", "0.003"],
        "anchors_64": ["--anchors_per_row", "64"],
        "loss_kl": ["--loss_type", "kl"],
        "data_teacher_forced": ["--responses", "runs/data/tf_code_math_small.jsonl.gz"],
        "data_mixed": [
            "--responses",
            "data/smollm2-135m-instruct/code_math_responses.jsonl.gz,runs/data/tf_code_math_small.jsonl.gz",
        ],
    },
}
# The teacher-forced files of the data rungs (made in a minute, not committed):
TEACHER_FORCED = {
    "runs/data/tf_chat.jsonl.gz": "angelspec teacher-forced --sources alpaca_eval,self_instruct,self_instruct_seed,mtbench101 "
    "--output runs/data/tf_chat.jsonl.gz",
    "runs/data/tf_code_math_small.jsonl.gz": "angelspec teacher-forced --sources gsm8k_train,code_alpaca,mbpp_train "
    "--limit-per-source 400 --output runs/data/tf_code_math_small.jsonl.gz",
}


def rung_command(config: str, output_dir: str, overrides: list[str], extra: list[str]) -> list[str]:
    return [
        sys.executable,
        os.path.join(HERE, "train_drafter.py"),
        "--config",
        config,
        "--output_dir",
        output_dir,
        *overrides,
        *extra,
    ]


def final_evaluation(output_dir: str) -> dict | None:
    """The last `eval_*` entry of a finished rung's trainer state, or None."""
    path = os.path.join(output_dir, "trainer_state.json")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        history = json.load(handle)["log_history"]
    evaluations = [entry for entry in history if "eval_tau" in entry]
    return {**evaluations[-1], "steps": history[-1].get("step")} if evaluations else None


def by_depth(result: dict, prefix: str) -> list[float]:
    depths = sorted(int(key[len(prefix) :]) for key in result if key.startswith(prefix))
    return [result[f"{prefix}{depth}"] for depth in depths]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--output", required=True, help="folder of the rungs' runs and the table")
    parser.add_argument("--rungs", default=None, help="comma-separated rung names (default: all of the drafter type)")
    parser.add_argument("--parallel", type=int, default=2, help="rungs at a time, one thread each")
    parser.add_argument(
        "--minutes", type=float, default=None, help="CPU minutes per rung (default: the config's max_cpu_minutes)"
    )
    parser.add_argument("--prepare", action="store_true", help="only compute the hidden-state caches the rungs read")
    args = parser.parse_args(argv)
    with open(args.config) as handle:
        drafter_type = yaml.safe_load(handle)["drafter_type"]
    rungs = RUNGS[drafter_type]
    names = args.rungs.split(",") if args.rungs else list(rungs)
    unknown = [name for name in names if name not in rungs]
    if unknown:
        raise SystemExit(f"unknown rungs {unknown}; {drafter_type} has {list(rungs)}")
    os.makedirs(args.output, exist_ok=True)
    for path, command in TEACHER_FORCED.items():
        if any(path in part for name in names for part in rungs[name]) and not os.path.exists(path):
            subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), command.split()[0]), *command.split()[1:]], check=True
            )

    if args.prepare:  # one-step runs compute (or verify) the caches of the base and of each rung with its own data
        for overrides in [[]] + [rungs[name] for name in names if "--responses" in rungs[name]]:
            command = rung_command(args.config, os.path.join(args.output, "prepare"), overrides, ["--max_steps", "1"])
            subprocess.run(command, check=True)
        return
    budget = [] if args.minutes is None else ["--max_cpu_minutes", str(args.minutes)]

    one_thread = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    todo = [name for name in names if final_evaluation(os.path.join(args.output, name)) is None]
    running: list[tuple[str, subprocess.Popen, float]] = []
    while todo or running:
        while todo and len(running) < args.parallel:
            name = todo.pop(0)
            shutil.rmtree(os.path.join(args.output, name), ignore_errors=True)
            log = open(os.path.join(args.output, f"{name}.log"), "a")
            process = subprocess.Popen(
                rung_command(args.config, os.path.join(args.output, name), rungs[name], budget),
                env=one_thread,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            running.append((name, process, time.time()))
            print(f"started {name}", flush=True)
        time.sleep(10)
        for name, process, started in list(running):
            if process.poll() is not None:
                running.remove((name, process, started))
                print(f"{name}: exit {process.returncode} after {(time.time() - started) / 60:.1f} min", flush=True)

    # The table covers every rung of this output folder, so the ladder can be run in parts (`--rungs`).
    results = {name: final_evaluation(os.path.join(args.output, name)) for name in rungs}
    results = {name: result for name, result in results.items() if result is not None or name in names}
    with open(os.path.join(args.output, "ladder.json"), "w") as handle:
        json.dump(
            {"config": args.config, "rungs": {n: rungs[n] for n in results}, "results": results}, handle, indent=1
        )
    lines = [
        "| rung | steps | offline τ | τ by draft length | acceptance by depth | top-4 recall, depth 1 | eval loss |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for name, result in sorted(results.items(), key=lambda item: -(item[1] or {}).get("eval_tau", 0)):
        if result is None:
            lines.append(f"| {name} | – | failed | | | | |")
            continue
        taus = " / ".join(f"{value:.2f}" for value in by_depth(result, "eval_tau_depth_"))
        rates = " / ".join(f"{value:.2f}" for value in by_depth(result, "eval_acceptance_depth_"))
        lines.append(
            f"| {name} | {result['steps']} | {result['eval_tau']:.3f} | {taus} | {rates} | "
            f"{result.get('eval_recall_top4_depth_1', 0):.2f} | {result.get('eval_loss', 0):.3f} |"
        )
    with open(os.path.join(args.output, "ladder.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
