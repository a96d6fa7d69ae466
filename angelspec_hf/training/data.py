"""Training data for drafters: regenerated chat responses, document-aware packing, target hidden states.

Pipeline (all `datasets`, so every stage is cached on disk and memory-mapped):
  responses file -> one example per conversation (`input_ids`, `loss_mask` on response tokens)
  -> packing into fixed-length rows; `position_ids` and `document_ids` restart per document, so attention and RoPE
     never cross a document (the target's packed-sequence mask does the same for the hidden states)
  -> optionally, target hidden states precomputed once into an Arrow cache (offline mode).
"""

from __future__ import annotations

import os

import datasets
import torch
import torch.nn.functional as F

from .regenerate import read_responses


def conversations_dataset(responses_path: str, max_length: int) -> datasets.Dataset:
    """One example per regenerated conversation: prompt + response ids, loss only on the response.

    `responses_path` may list several files, comma-separated (e.g. chat and code/math responses).
    """
    missing = [path for path in responses_path.split(",") if not os.path.exists(path)]
    if missing:
        raise FileNotFoundError(f"Responses file(s) not found: {', '.join(missing)}; run `angelspec regenerate` first")
    records = read_responses(responses_path)
    if not records:
        raise FileNotFoundError(f"No regenerated responses in {responses_path}: run `angelspec regenerate` first")

    def to_example(record):
        ids = (record["prompt_ids"] + record["response_ids"])[:max_length]
        mask = ([0] * len(record["prompt_ids"]) + [1] * len(record["response_ids"]))[:max_length]
        return {"input_ids": ids, "loss_mask": mask}

    examples = [to_example(record) for record in records]
    return datasets.Dataset.from_list([example for example in examples if any(example["loss_mask"])])


def pack_documents(dataset: datasets.Dataset, max_length: int) -> datasets.Dataset:
    """Greedily pack examples into rows of at most `max_length` tokens, keeping document boundaries."""

    def pack(batch):
        rows = {"input_ids": [], "loss_mask": [], "position_ids": [], "document_ids": []}
        current = {key: [] for key in rows}
        document = 0

        def flush():
            if current["input_ids"]:
                for key in rows:
                    rows[key].append(current[key])
            return {key: [] for key in rows}

        for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
            if len(current["input_ids"]) + len(ids) > max_length:
                current, document = flush(), 0
            current["input_ids"] += ids
            current["loss_mask"] += mask
            current["position_ids"] += list(range(len(ids)))
            current["document_ids"] += [document] * len(ids)
            document += 1
        flush()
        return rows

    return dataset.map(pack, batched=True, batch_size=1000, remove_columns=dataset.column_names)


def build_training_dataset(responses_path: str, max_length: int, seed: int = 0) -> datasets.Dataset:
    examples = conversations_dataset(responses_path, max_length).shuffle(seed=seed)
    return pack_documents(examples, max_length)


@torch.no_grad()
def target_hidden_states(target, input_ids: torch.Tensor, position_ids: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
    """The target's hidden states at `indices` for packed rows (no cache, so transformers masks per document)."""
    output = target(input_ids=input_ids, position_ids=position_ids, use_cache=False, output_hidden_states=True)
    return [output.hidden_states[i] for i in indices]


def precompute_hidden_states(
    dataset: datasets.Dataset, target, indices: list[int], cache_dir: str, dtype: str = "float16", batch_size: int = 4
) -> datasets.Dataset:
    """Offline mode: add `target_hidden` ([T, len(indices), H] per row) computed once and memory-mapped from disk."""
    os.makedirs(cache_dir, exist_ok=True)
    hidden_size = target.config.get_text_config().hidden_size
    features = dataset.features.copy()
    features["target_hidden"] = datasets.Array3D(shape=(None, len(indices), hidden_size), dtype=dtype)
    torch_dtype = getattr(torch, dtype)

    def add_hidden(batch):
        out = []
        for ids, positions in zip(batch["input_ids"], batch["position_ids"]):
            states = target_hidden_states(target, torch.tensor([ids]), torch.tensor([positions]), indices)
            out.append(torch.stack([s[0] for s in states], dim=1).to(torch_dtype).numpy())
        return {"target_hidden": out}

    fingerprint = f"{dataset._fingerprint}-{target.config.name_or_path}-{indices}-{dtype}".replace("/", "_")
    return dataset.map(
        add_hidden,
        batched=True,
        batch_size=batch_size,
        features=features,
        cache_file_name=os.path.join(cache_dir, f"hidden-{fingerprint[-120:]}.arrow"),
        new_fingerprint=fingerprint[-64:],
        desc="target hidden states",
    ).with_format("torch")


class PackedCollator:
    """Pad packed rows to the longest in the batch; padding is its own document with no loss."""

    PAD_VALUES = {"input_ids": 0, "loss_mask": 0, "document_ids": -1}

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(row["input_ids"]) for row in rows)
        batch = {}
        for key, value in self.PAD_VALUES.items():
            batch[key] = torch.stack(
                [F.pad(torch.as_tensor(row[key]), (0, width - len(row[key])), value=value) for row in rows]
            )
        # Padding positions count up from 0 like a document of their own.
        batch["position_ids"] = torch.stack(
            [torch.cat([torch.as_tensor(row["position_ids"]), torch.arange(width - len(row["position_ids"]))]) for row in rows]
        )
        if "target_hidden" in rows[0]:  # stored [T, N, H]; the drafter reads [B, N, T, H]
            batch["target_hidden"] = torch.stack(
                [F.pad(torch.as_tensor(row["target_hidden"]), (0, 0, 0, 0, 0, width - len(row["input_ids"]))) for row in rows]
            ).transpose(1, 2)
        return batch
