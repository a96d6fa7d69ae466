"""`AngelSpecTrainer`: a `transformers.Trainer` whose loss is the drafter's distillation to the frozen target.

One trainer for every drafter. The drafter's `forward` unrolls its drafting exactly as inference will (MTP: the
TTT rollout of §2.2) and returns its supervised predictions with the target positions they are distilled to; the
trainer supplies the target's hidden states (online from the target in this process, or offline from the
precomputed cache), applies the target's lm_head there as the teacher, and weights each draft position.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict

import torch
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput, SaveStrategy, rotate_checkpoints
from transformers.utils import logging

from .data import batch_hidden_states
from .evaluation import estimate_acceptance
from .losses import feature_regression_loss, position_weighted_loss, with_feature_noise


logger = logging.get_logger(__name__)


def checkpoint_folders(output_dir: str) -> list[str]:
    """The `checkpoint-N` folders of `output_dir`, newest (highest N) first; complete or not."""
    steps = {}
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        match = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            steps[int(match.group(1))] = os.path.join(output_dir, name)
    return [steps[step] for step in sorted(steps, reverse=True)]


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` of `output_dir` with a readable `trainer_state.json`, or None.

    Newer incomplete ones (a save that was killed, left by a version that wrote checkpoints in place) are skipped
    with a warning naming them, and left on disk.
    """
    for path in checkpoint_folders(output_dir):
        try:
            with open(os.path.join(path, TRAINER_STATE_NAME)) as handle:
                json.load(handle)
        except (OSError, ValueError) as error:
            logger.warning(f"Skipping the incomplete checkpoint {path} ({error}): its save did not finish.")
            continue
        return path
    return None


class AngelSpecTrainer(Trainer):
    """Trainer for AngelSpec drafters.

    Args:
        target: the frozen target model. Needed for online hidden states; in offline mode (rows carry
            `target_hidden`) it is still needed for its embedding and lm_head, which the drafter borrows.
    """

    def __init__(self, *args, target=None, **kwargs):
        args_ = kwargs.get("args") or (args[1] if len(args) > 1 else None)
        if args_ is not None:
            args_.remove_unused_columns = False  # loss_mask and target_hidden are not forward() arguments
        super().__init__(*args, **kwargs)
        if target is None:
            raise ValueError("AngelSpecTrainer needs the target model (target=...)")
        self.target = target.eval().requires_grad_(False)
        self.drafter.bind_target(self.target)
        self._metrics: dict[str, list[float]] = defaultdict(list)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint=True` resumes from `last_complete_checkpoint(output_dir)`."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint found in output directory ({self.args.output_dir})")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """`Trainer._save_checkpoint`, made atomic: every process writes into `tmp-checkpoint-N`, which the saving
        process renames to `checkpoint-N` once complete, so a run killed while saving leaves no partial checkpoint
        where resuming looks (the next save of step N removes the remains)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        output_dir = os.path.join(run_dir, checkpoint_folder)
        staging_dir = os.path.join(run_dir, f"tmp-{checkpoint_folder}")
        if self.args.should_save and os.path.isdir(staging_dir):
            logger.warning(f"Removing {staging_dir}, the remains of a save that did not finish.")
            shutil.rmtree(staging_dir, ignore_errors=True)
        self.accelerator.wait_for_everyone()

        self.save_model(staging_dir, _internal_call=True)
        tracks_best = self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        if tracks_best and self.state.best_global_step:
            self.accelerator.wait_for_everyone()  # the best checkpoint may be the one being written
            best_checkpoint_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if self.state.best_global_step == self.state.global_step or os.path.exists(best_checkpoint_dir):
                self.state.best_model_checkpoint = best_checkpoint_dir
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(staging_dir)
            self._save_scaler(staging_dir)
            self._save_rng_state(staging_dir)
        if self.args.should_save:
            for callback in self.callback_handler.callbacks + [self.control]:
                if isinstance(callback, ExportableState):
                    name, callback_state = callback.__class__.__name__, callback.state()
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(callback_state)
                    else:
                        self.state.stateful_callbacks[name] = callback_state
            self.state.save_to_json(os.path.join(staging_dir, TRAINER_STATE_NAME))

        self.accelerator.wait_for_everyone()  # every process has written its part (RNG states, shards)
        if self.args.should_save and os.path.isdir(staging_dir):
            if os.path.isdir(output_dir):
                logger.warning(f"Replacing the existing checkpoint {output_dir}.")
                shutil.rmtree(output_dir)
            os.replace(staging_dir, output_dir)
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    @property
    def drafter(self):
        return self.accelerator.unwrap_model(self.model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Under `bf16` / `fp16` the whole step runs in autocast, not only the drafter's forward (what accelerate wraps):
        # the teacher's head and the loss are a large part of a step on a CPU.
        with self.accelerator.autocast():
            return self._compute_loss(model, inputs, return_outputs)

    def _compute_loss(self, model, inputs, return_outputs):
        drafter = self.drafter
        hidden = batch_hidden_states(drafter, self.target, inputs)
        outputs = model(
            target_hidden=with_feature_noise(hidden, drafter.config.hidden_noise_std) if model.training else hidden,
            input_ids=inputs["input_ids"],
            position_ids=inputs["position_ids"],
            document_ids=inputs["document_ids"],
            loss_mask=inputs["loss_mask"],
        )
        with torch.no_grad():  # the teacher: the target's lm_head on its final state, only where it is needed
            teacher = drafter.target_head_logits(hidden[:, -1].flatten(0, 1)[outputs.teacher_positions])
        loss = position_weighted_loss(drafter, outputs.logits, teacher, outputs.draft_positions)
        if outputs.hidden_states is not None:
            final = hidden[:, -1].flatten(0, 1)[outputs.teacher_positions]
            loss = loss + drafter.config.hidden_regression_weight * feature_regression_loss(
                outputs.hidden_states, final
            )
        with torch.no_grad():
            agrees = outputs.logits.argmax(-1) == teacher.argmax(-1)
            for position in outputs.draft_positions.unique().tolist():
                agreement = agrees[outputs.draft_positions == position].float().mean().item()
                self._metrics[f"top1_agreement_position_{position}"].append(agreement)
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """Evaluation is the offline acceptance estimate (`estimate_acceptance`) on the eval dataset — held-out
        target-generated responses — with its distillation loss: `eval_tau`, `eval_tau_depth_k`,
        `eval_acceptance_depth_k`, `eval_recall_top{n}_depth_k`, `eval_loss`, each usable as `metric_for_best_model`."""
        metrics = estimate_acceptance(self.drafter, dataloader, self.target)
        num_samples = metrics["documents"]
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in metrics.items()}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=num_samples)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the averaged per-depth agreement and the latest acceptance measurements to every training log."""
        if "loss" in logs:
            logs.update({key: sum(values) / len(values) for key, values in self._metrics.items() if values})
            self._metrics.clear()
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "pop_metrics"):
                logs.update(callback.pop_metrics())
        super().log(logs, start_time)
