"""Train an AngelSpec drafter (MTP with training-time test, or DFly / its DFlash ablation) with `AngelSpecTrainer`.

    accelerate launch examples/train_drafter.py --config examples/configs/smollm2_mtp.yaml
    accelerate launch --multi_gpu --num_processes 2 examples/train_drafter.py --config ...   # CPU DDP (gloo)

The YAML holds the fields of `DrafterArguments`, `DataArguments` and `transformers.TrainingArguments`; any
`--field value` after `--config` overrides it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field


os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import concatenate_datasets  # noqa: E402
from transformers import TrainerState, TrainingArguments, set_seed  # noqa: E402
from trl import TrlParser  # noqa: E402

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter, load_target  # noqa: E402
from angelspec_hf.hub import resolve_drafter  # noqa: E402
from angelspec_hf.prompts import check_prompt_source, encode_chat, load_prompts  # noqa: E402
from angelspec_hf.training import (  # noqa: E402
    AcceptanceCallback,
    AngelSpecTrainer,
    CpuClockCallback,
    GracefulStopCallback,
    PackedCollator,
    build_training_dataset,
    last_complete_checkpoint,
    precompute_hidden_states,
)
from angelspec_hf.training.continuation import checkpoint_from_card  # noqa: E402
from angelspec_hf.training.data import check_compute_dtype  # noqa: E402
from angelspec_hf.training.precision import Bf16Choice  # noqa: E402
from angelspec_hf.training.regenerate import read_responses  # noqa: E402


@dataclass
class DrafterArguments:
    target: str = field(
        default="smollm2", metadata={"help": "target: 'smollm2' (embedded), a folder, or dir::file.gguf"}
    )
    target_dtype: str = field(
        default="float32", metadata={"help": "the target's dtype, for its states and teacher (bfloat16 on a GPU)"}
    )
    drafter_type: str = field(default="mtp", metadata={"help": "mtp | dfly"})
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "a trained drafter folder or shipped card name to start from (its architecture, weights and draft "
            "vocabulary; the run has its own optimizer and schedule): continued training on new data"
        },
    )
    continue_from: str | None = field(
        default=None,
        metadata={
            "help": "a card `angelspec snapshot` wrote from this run: when output_dir holds no checkpoint (a new "
            "machine), the run goes on from the card's weights and history (steps, CPU-hours, tokens), with a fresh "
            "optimizer and warm-up"
        },
    )
    draft_vocab_size: int | None = field(default=None, metadata={"help": "reduced draft vocabulary size (None: full)"})
    loss_type: str = field(default="kl", metadata={"help": "kl | ce | tv | lk"})
    kl_top_k: int | None = field(default=None, metadata={"help": "distil only the teacher's top-k tokens"})
    lk_eta: float = field(default=3.0, metadata={"help": "η of the lk loss"})
    hidden_noise_std: float = field(default=0.0, metadata={"help": "noise on the target states read in training"})
    warm_start: bool = field(
        default=False, metadata={"help": "draft layers and final norm copied from the target's last"}
    )
    zero_output_projections: bool = field(default=False, metadata={"help": "residual output projections start at 0"})
    lora_r: int = field(
        default=0,
        metadata={
            "help": "adapt the drafter (usually `init_from`) with peft's LoRA of this rank on its own linear layers; "
            "the output folder gets the adapter and, in merged/, the merged drafter (0: train every weight)"
        },
    )
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "tapped target layers (MTP default: the last; DFly default: 5 spread out)"}
    )
    # MTP
    num_depths: int = field(default=3, metadata={"help": "MTP: D, draft tokens per round = TTT depths"})
    training_time_test: bool = field(default=True, metadata={"help": "MTP: unroll the depths in training (TTT)"})
    ttt_token_choice: str = field(default="argmax", metadata={"help": "MTP: argmax | sample | ground_truth"})
    depth_loss_weights: list[float] | None = field(default=None, metadata={"help": "MTP: per-depth loss weights"})
    hidden_regression_weight: float = field(default=0.0, metadata={"help": "MTP: EAGLE-1 feature regression weight"})
    input_layout: str | None = field(
        default=None,
        metadata={
            "help": "MTP: projection (eq. 1; a new drafter's default) | eagle3 (EAGLE-3's midlayer, exports to "
            "vLLM/SGLang EAGLE-3); with init_from, another layout than the card's starts from the tensors they share"
        },
    )
    native_mtp: bool = field(
        default=False,
        metadata={"help": "MTP: start from the target's own MTP layer (DeepSeek-V3 / GLM-4.5 layout, num_mtp_layers)"},
    )
    # DFly
    block_size: int = field(default=16, metadata={"help": "DFly: block size (anchor + drafts)"})
    num_draft_layers: int = field(default=3, metadata={"help": "DFly: draft decoder layers"})
    mask_token_id: int | None = field(default=None, metadata={"help": "DFly: mask token id (default: unk/pad)"})
    per_layer_context_mix: bool = field(default=True, metadata={"help": "DFly: hybrid conditioning (off: DFlash)"})
    ar_head: bool = field(default=True, metadata={"help": "DFly: predecessor-conditioned head (off: DFlash)"})
    position_decay_gamma: float = field(default=7.0, metadata={"help": "DFly: γ of the block position weights"})
    anchors_per_row: int = field(default=32, metadata={"help": "DFly: random anchor blocks per packed row"})
    bf16_where_faster: bool = field(
        default=False,
        metadata={
            "help": "measure the target's prefill and a draft layer's training step in float32 and under bf16 "
            "autocast on this machine and use bf16 for each where it is at least 1.1x faster: sets "
            "hidden_compute_dtype and bf16 (leave both unset)"
        },
    )

    def __post_init__(self):
        if self.drafter_type != "mtp" and (self.native_mtp or self.input_layout is not None):
            raise ValueError("native_mtp and input_layout are MTP options; drafter_type is " + repr(self.drafter_type))
        if self.native_mtp and (self.warm_start or self.init_from):
            raise ValueError("native_mtp is a starting point of its own: drop warm_start / init_from")
        if self.continue_from and not os.path.isdir(self.continue_from):
            raise ValueError(f"continue_from {self.continue_from!r}: no such card folder")

    def build(self, target, tokenizer, start_from: str | None = None):
        """A fresh drafter of `drafter_type` for `target` (warm-started from it when asked), or the one in
        `start_from` or `init_from` (trained in float32 whatever the folder stores)."""
        if start_from or self.init_from:
            path = resolve_drafter(start_from or self.init_from)
            if self.init_from and not start_from and self.drafter_type == "mtp" and self.input_layout is not None:
                drafter = AngelSpecMTPDrafter.from_other_layout(path, self.input_layout, dtype=torch.float32)
            else:
                drafter_class = {"mtp": AngelSpecMTPDrafter, "dfly": DFlyDrafter}[self.drafter_type]
                drafter = drafter_class.from_pretrained(path, dtype=torch.float32)
            drafter.bind_target(target, tokenizer)
            return drafter
        drafter = self._new(target, tokenizer)
        if self.warm_start:
            drafter.warm_start(target)
        if self.zero_output_projections:
            drafter.zero_output_projections()
        return drafter

    def _new(self, target, tokenizer):
        common = dict(
            draft_vocab_size=self.draft_vocab_size,
            loss_type=self.loss_type,
            kl_top_k=self.kl_top_k,
            lk_eta=self.lk_eta,
            hidden_noise_std=self.hidden_noise_std,
            target_layer_ids=self.target_layer_ids,
        )
        if self.drafter_type == "mtp":
            start = AngelSpecMTPDrafter.from_native_mtp if self.native_mtp else AngelSpecMTPDrafter.from_target
            return start(
                target,
                tokenizer,
                num_depths=self.num_depths,
                training_time_test=self.training_time_test,
                ttt_token_choice=self.ttt_token_choice,
                depth_loss_weights=self.depth_loss_weights,
                hidden_regression_weight=self.hidden_regression_weight,
                input_layout=self.input_layout or "projection",
                **common,
            )
        if self.drafter_type == "dfly":
            mask = self.mask_token_id
            if mask is None:
                mask = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else tokenizer.pad_token_id
            return DFlyDrafter.from_target(
                target,
                tokenizer,
                block_size=self.block_size,
                num_draft_layers=self.num_draft_layers,
                mask_token_id=mask,
                per_layer_context_mix=self.per_layer_context_mix,
                ar_head=self.ar_head,
                position_decay_gamma=self.position_decay_gamma,
                anchors_per_row=self.anchors_per_row,
                **common,
            )
        raise ValueError(f"drafter_type must be 'mtp' or 'dfly', got {self.drafter_type!r}")


@dataclass
class DataArguments:
    responses: str = field(metadata={"help": "gzipped JSONL of regenerated responses (angelspec regenerate)"})
    max_length: int = field(default=1024, metadata={"help": "tokens per packed row"})
    hidden_states: str = field(default="offline", metadata={"help": "offline (precomputed cache) | online"})
    hidden_cache_dir: str = field(default=".cache/hidden_states", metadata={"help": "where offline states go"})
    hidden_dtype: str = field(default="float16", metadata={"help": "storage dtype of offline states"})
    hidden_compute_dtype: str = field(
        default="float32",
        metadata={
            "help": "the target's precision computing offline training states: float32, or bfloat16 (autocast, "
            "faster on CPUs with AMX / avx512_bf16); held-out evaluation states are always computed as loaded"
        },
    )
    hidden_cache_indices: list[int] | None = field(
        default=None,
        metadata={
            "help": "target hidden_states indices to cache (a superset of the drafter's: one cache, many drafters)"
        },
    )
    eval_responses: str | None = field(
        default=None,
        metadata={"help": "held-out target responses: the Trainer's evaluation is their offline acceptance estimate"},
    )
    eval_response_sources: str | None = field(default=None, metadata={"help": "only these sources of eval_responses"})
    eval_sources: str = field(default="mt_bench", metadata={"help": "held-back prompts for the acceptance callback"})
    eval_prompts: int = field(default=0, metadata={"help": "how many held-back prompts (0: no acceptance callback)"})
    eval_max_new_tokens: int = field(default=64)
    eval_every_n_steps: int = field(default=100)
    data_dir: str | None = field(default=None, metadata={"help": "local prompt folder (default $ANGELSPEC_DATA_DIR)"})
    max_cpu_minutes: float | None = field(
        default=None,
        metadata={"help": "stop (evaluate, save) once training used this much CPU time, over resumed parts: a budget"},
    )
    max_wall_minutes: float | None = field(
        default=None, metadata={"help": "stop (evaluate, save) after this much wall-clock time of training"}
    )

    def __post_init__(self):
        check_compute_dtype(self.hidden_compute_dtype, "hidden_compute_dtype")


def parse_arguments(argv: list[str]):
    """`--config FILE.yaml` anywhere in `argv` supplies defaults (TRL's parser: YAML types kept, `null` included,
    an `env:` mapping exported, unknown keys refused); the other `--field value` pairs override them."""
    parser = TrlParser((DrafterArguments, DataArguments, TrainingArguments))
    return parser.parse_args_and_config(args=argv)


def main(argv: list[str]) -> None:
    drafter_args, data_args, training_args = parse_arguments(argv)
    if drafter_args.bf16_where_faster and (training_args.bf16 or data_args.hidden_compute_dtype != "float32"):
        raise ValueError("bf16_where_faster chooses bf16 and hidden_compute_dtype by measurement: leave both unset")
    set_seed(training_args.seed)
    if data_args.eval_prompts:  # a prompt set that cannot be read is named before the target loads
        check_prompt_source(data_args.eval_sources, data_args.data_dir)
    # The target sits on the training device (a GPU when there is one and `use_cpu` is off).
    target = load_target(drafter_args.target, dtype=drafter_args.target_dtype, device=str(training_args.device))
    if drafter_args.bf16_where_faster:
        choice = Bf16Choice.measure(target.model)
        print(choice.describe(), flush=True)
        # parsed again with the choice, so that TrainingArguments derives what follows from `bf16` as it does
        drafter_args, data_args, training_args = parse_arguments(argv + choice.arguments())
    records = read_responses(data_args.responses)

    # A checkpoint killed mid-save is never resumed from: saves are atomic, incomplete leftovers are skipped.
    last = training_args.resume_from_checkpoint or last_complete_checkpoint(training_args.output_dir)
    continued = last is None and drafter_args.continue_from
    if continued:
        last = checkpoint_from_card(drafter_args.continue_from, training_args.output_dir)
        print(
            f"no checkpoint in {training_args.output_dir}: continuing the run from {drafter_args.continue_from} "
            f"({last}), with a fresh optimizer and warm-up",
            flush=True,
        )
    drafter = drafter_args.build(
        target.model, target.tokenizer, start_from=drafter_args.continue_from if continued else None
    )
    if drafter_args.draft_vocab_size and not (drafter_args.init_from or continued):
        counts = torch.zeros(drafter.config.vocab_size)
        for record in records:
            counts += torch.bincount(torch.tensor(record["response_ids"]), minlength=counts.numel())[: counts.numel()]
        eos = target.model.generation_config.eos_token_id
        drafter.init_draft_vocab(counts, always_keep=eos if isinstance(eos, list) else [eos])

    if drafter_args.lora_r:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=drafter_args.lora_r,
            lora_alpha=drafter_args.lora_alpha,
            lora_dropout=drafter_args.lora_dropout,
            target_modules=drafter.lora_target_modules(),
        )
        drafter = get_peft_model(drafter, lora)

    if data_args.hidden_states not in ("offline", "online"):
        raise ValueError(f"hidden_states must be 'offline' or 'online', got {data_args.hidden_states!r}")

    needed = drafter.training_hidden_state_indices()
    cached = data_args.hidden_cache_indices or needed
    missing = [i for i in needed if i not in cached]
    if missing:
        raise ValueError(f"hidden_cache_indices {cached} lack the drafter's hidden states {missing}")
    select = None if cached == needed else [cached.index(i) for i in needed]

    def with_hidden_states(dataset, compute_dtype="float32"):
        if data_args.hidden_states == "online":
            return dataset
        with training_args.main_process_first(desc="precomputing target hidden states"):
            return precompute_hidden_states(
                dataset,
                target.model,
                cached,
                data_args.hidden_cache_dir,
                dtype=data_args.hidden_dtype,
                compute_dtype=compute_dtype,
            )

    # Each responses file is packed and cached on its own, so a mix of files reuses every file's cache.
    dataset = concatenate_datasets(
        [
            with_hidden_states(
                build_training_dataset(path, data_args.max_length, seed=training_args.seed),
                data_args.hidden_compute_dtype,
            )
            for path in data_args.responses.split(",")
        ]
    )
    eval_dataset = None
    if data_args.eval_responses:
        sources = data_args.eval_response_sources.split(",") if data_args.eval_response_sources else None
        eval_dataset = with_hidden_states(
            build_training_dataset(data_args.eval_responses, data_args.max_length, sources=sources)
        )

    trained_prompts = {record["prompt"] for record in records}
    held_back = [
        torch.tensor([encode_chat(target.tokenizer, row["prompt"])])
        for row in (
            load_prompts(data_args.eval_sources, data_dir=data_args.data_dir) if data_args.eval_prompts else []
        )
        if row["prompt"] not in trained_prompts
    ][: data_args.eval_prompts]
    callbacks = [CpuClockCallback(data_args.max_cpu_minutes, data_args.max_wall_minutes), GracefulStopCallback()]
    if held_back:
        callbacks.append(
            AcceptanceCallback(
                target.model, held_back, data_args.eval_max_new_tokens, every_n_steps=data_args.eval_every_n_steps
            )
        )
    trainer = AngelSpecTrainer(
        model=drafter,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        data_collator=PackedCollator(select=select if data_args.hidden_states == "offline" else None),
        callbacks=callbacks,
        processing_class=target.tokenizer,  # saved in every checkpoint: a snapshot of one is a whole card
        target=target.model,
    )
    print(f"world size {trainer.accelerator.num_processes}, {len(dataset)} packed rows", flush=True)
    finished = last is not None and TrainerState.load_from_json(os.path.join(last, "trainer_state.json"))
    if finished and 0 < training_args.max_steps <= finished.global_step:
        # The run had trained all its steps and was stopped in its final save: finish that save, train no further
        # (resuming would run one step past max_steps).
        trainer._load_from_checkpoint(last)
        trainer.state = finished
    else:
        trainer.train(resume_from_checkpoint=last)
    trainer.save_model(training_args.output_dir)  # with LoRA, the adapter (load_drafter loads it onto its base)
    if drafter_args.lora_r:
        trainer.model.merge_and_unload().save_pretrained(os.path.join(training_args.output_dir, "merged"))
    trainer.save_state()  # trainer_state.json with the whole log history, acceptance measurements included


if __name__ == "__main__":
    main(sys.argv[1:])
