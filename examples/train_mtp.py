"""Train an AngelSpec MTP drafter with training-time test (AngelSpec §2.2).

    accelerate launch examples/train_mtp.py --config examples/configs/smollm2_mtp.yaml
    accelerate launch --multi_gpu --num_processes 2 examples/train_mtp.py --config ...   # CPU DDP (gloo)

The YAML holds the fields of `DrafterArguments`, `DataArguments` and `transformers.TrainingArguments`; any
`--field value` after `--config` overrides it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import HfArgumentParser, TrainingArguments, set_seed  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from angelspec_hf import AngelSpecMTPDrafter, load_target  # noqa: E402
from angelspec_hf.prompts import encode_chat, load_prompts  # noqa: E402
from angelspec_hf.training import (  # noqa: E402
    AcceptanceCallback,
    AngelSpecTrainer,
    PackedCollator,
    build_training_dataset,
    precompute_hidden_states,
)
from angelspec_hf.training.regenerate import read_responses  # noqa: E402


@dataclass
class DrafterArguments:
    target: str = field(default="smollm2", metadata={"help": "target: 'smollm2' (embedded), a folder, or dir::file.gguf"})
    num_depths: int = field(default=3, metadata={"help": "D: draft tokens per round = TTT depths"})
    draft_vocab_size: int | None = field(default=None, metadata={"help": "reduced draft vocabulary size (None: full)"})
    ttt_token_choice: str = field(default="argmax", metadata={"help": "argmax | sample | ground_truth (no TTT)"})
    depth_loss_weights: list[float] | None = field(default=None, metadata={"help": "per-depth loss weights"})
    kl_top_k: int | None = field(default=None, metadata={"help": "distil only the teacher's top-k tokens"})


@dataclass
class DataArguments:
    responses: str = field(metadata={"help": "gzipped JSONL of regenerated responses (angelspec regenerate)"})
    max_length: int = field(default=1024, metadata={"help": "tokens per packed row"})
    hidden_states: str = field(default="offline", metadata={"help": "offline (precomputed cache) | online"})
    hidden_cache_dir: str = field(default=".cache/hidden_states", metadata={"help": "where offline states go"})
    hidden_dtype: str = field(default="float16", metadata={"help": "storage dtype of offline states"})
    eval_sources: str = field(default="mt_bench", metadata={"help": "held-back prompts for the acceptance callback"})
    eval_prompts: int = field(default=4, metadata={"help": "how many held-back prompts"})
    eval_max_new_tokens: int = field(default=64)
    eval_every_n_steps: int = field(default=100)
    data_dir: str | None = field(default=None, metadata={"help": "local prompt folder (default ../shared/data)"})


def parse_arguments(argv: list[str]):
    parser = HfArgumentParser((DrafterArguments, DataArguments, TrainingArguments))
    if argv[:1] == ["--config"]:
        with open(argv[1]) as handle:
            values = yaml.safe_load(handle) or {}
        flat = []
        for key, value in values.items():
            flat.append(f"--{key}")
            flat += [str(v) for v in value] if isinstance(value, list) else [str(value)]
        argv = flat + argv[2:]
    return parser.parse_args_into_dataclasses(args=argv)


def main(argv: list[str]) -> None:
    drafter_args, data_args, training_args = parse_arguments(argv)
    set_seed(training_args.seed)
    target = load_target(drafter_args.target)
    records = read_responses(data_args.responses)

    drafter = AngelSpecMTPDrafter.from_target(
        target.model,
        target.tokenizer,
        num_depths=drafter_args.num_depths,
        draft_vocab_size=drafter_args.draft_vocab_size,
        ttt_token_choice=drafter_args.ttt_token_choice,
        depth_loss_weights=drafter_args.depth_loss_weights,
        kl_top_k=drafter_args.kl_top_k,
    )
    if drafter_args.draft_vocab_size:
        counts = torch.zeros(drafter.config.vocab_size)
        for record in records:
            counts += torch.bincount(torch.tensor(record["response_ids"]), minlength=counts.numel())[: counts.numel()]
        eos = target.model.generation_config.eos_token_id
        drafter.init_draft_vocab(counts, always_keep=eos if isinstance(eos, list) else [eos])

    dataset = build_training_dataset(data_args.responses, data_args.max_length, seed=training_args.seed)
    if data_args.hidden_states == "offline":
        with training_args.main_process_first(desc="precomputing target hidden states"):
            dataset = precompute_hidden_states(
                dataset, target.model, drafter.training_hidden_state_indices(), data_args.hidden_cache_dir,
                dtype=data_args.hidden_dtype,
            )
    elif data_args.hidden_states != "online":
        raise ValueError(f"hidden_states must be 'offline' or 'online', got {data_args.hidden_states!r}")

    trained_prompts = {record["prompt"] for record in records}
    held_back = [
        torch.tensor([encode_chat(target.tokenizer, row["prompt"])])
        for row in load_prompts(data_args.eval_sources, data_dir=data_args.data_dir)
        if row["prompt"] not in trained_prompts
    ][: data_args.eval_prompts]
    callback = AcceptanceCallback(
        target.model, held_back, data_args.eval_max_new_tokens, every_n_steps=data_args.eval_every_n_steps
    )
    trainer = AngelSpecTrainer(
        model=drafter,
        args=training_args,
        train_dataset=dataset,
        data_collator=PackedCollator(),
        callbacks=[callback],
        target=target.model,
    )
    print(f"world size {trainer.accelerator.num_processes}, {len(dataset)} packed rows", flush=True)
    last = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint or last)
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
