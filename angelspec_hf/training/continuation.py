"""Training runs that outlive their machine (issue 36): a run's best checkpoint as a committed card, and a run
continued from that card when its own checkpoints are gone.

`snapshot_run` writes the best complete checkpoint of a run (highest offline τ, `eval_tau`) into a card folder:
the drafter in float16, its config, and the run's `trainer_state.json` up to that checkpoint (every evaluation, the
CPU-hours and tokens spent). `checkpoint_from_card` turns such a card back into a checkpoint of a run folder —
weights and trainer state, no optimizer — so that `Trainer` resumes from it: the step count, the CPU-time clock
(`CpuClockCallback`) and the token count go on, the curve goes on in the same history, and the optimizer starts
afresh with the scheduler's warm-up. What is lost is the optimizer's moments and the data order.
"""

from __future__ import annotations

import os
import shutil

from transformers import TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import CONFIG_NAME, GENERATION_CONFIG_NAME

from .trainer import checkpoint_folders


def evaluated_tau(state: TrainerState) -> float | None:
    """The offline τ (`eval_tau`) of the weights `state` was saved with: the evaluation at its own step, or None
    (a checkpoint saved between evaluations, e.g. by a stop)."""
    at_step = [e["eval_tau"] for e in state.log_history if "eval_tau" in e and e.get("step") == state.global_step]
    return at_step[-1] if at_step else None


def complete_checkpoints(run_dir: str) -> list[tuple[str, TrainerState]]:
    """Every checkpoint of `run_dir` whose save finished (a readable trainer state), with that state."""
    found = []
    for path in checkpoint_folders(run_dir):
        try:
            found.append((path, TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_NAME))))
        except (OSError, ValueError):
            continue  # a save that did not finish
    return found


def best_checkpoint(run_dir: str) -> tuple[str, TrainerState]:
    """The complete checkpoint of `run_dir` whose weights scored the highest offline τ, and its trainer state."""
    scored = [
        (evaluated_tau(state), state.global_step, path, state)
        for path, state in complete_checkpoints(run_dir)
        if evaluated_tau(state) is not None
    ]
    if not scored:
        raise FileNotFoundError(f"{run_dir} holds no complete checkpoint evaluated at its step (eval_tau)")
    _, _, path, state = max(scored, key=lambda item: item[:2])
    return path, state


def snapshot_run(run_dir: str, card_dir: str) -> dict:
    """Write the best checkpoint of the run in `run_dir` into `card_dir` as a float16 drafter with the run's trainer
    state (the curve so far) and the target's tokenizer the checkpoint holds (the Trainer's `processing_class`); the
    card's other files (README, benchmarks) stay. Returns what was written."""
    import torch
    from transformers import AutoTokenizer

    from ..hub import load_drafter

    checkpoint, state = best_checkpoint(run_dir)
    drafter = load_drafter(checkpoint, dtype=torch.float32)
    staging = f"{card_dir.rstrip(os.sep)}.snapshot-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    drafter.to(torch.float16).save_pretrained(staging)
    if os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(staging)
    state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
    os.makedirs(card_dir, exist_ok=True)
    for name in sorted(os.listdir(staging)):  # each file replaced whole: a reader sees the old or the new one
        os.replace(os.path.join(staging, name), os.path.join(card_dir, name))
    shutil.rmtree(staging, ignore_errors=True)
    return {
        "checkpoint": checkpoint,
        "card": card_dir,
        "step": state.global_step,
        "eval_tau": evaluated_tau(state),
        "cpu_hours": max((entry.get("cpu_hours", 0.0) for entry in state.log_history), default=0.0),
        "tokens": state.num_input_tokens_seen,
    }


def checkpoint_from_card(card_dir: str, run_dir: str) -> str:
    """A checkpoint of `run_dir` made from a card `snapshot_run` wrote (weights, config, trainer state, no
    optimizer), for `Trainer.train(resume_from_checkpoint=...)`; its history records the continuation."""
    state_path = os.path.join(card_dir, TRAINER_STATE_NAME)
    if not os.path.isfile(state_path):
        raise FileNotFoundError(
            f"{card_dir} has no {TRAINER_STATE_NAME}: only a card written by snapshot_run carries the run to continue"
        )
    state = TrainerState.load_from_json(state_path)
    state.log_history.append(
        {
            "step": state.global_step,
            "continued_from": card_dir,
            "note": "the run's checkpoints were gone: weights and history from the card, a fresh optimizer",
        }
    )
    folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    staging = os.path.join(run_dir, f"tmp-{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    for name in os.listdir(card_dir):  # the drafter itself: weights and configs, not the card's records
        if name.endswith(".safetensors") or name in (CONFIG_NAME, GENERATION_CONFIG_NAME):
            shutil.copy2(os.path.join(card_dir, name), staging)
    state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
    os.replace(staging, folder)
    return folder
