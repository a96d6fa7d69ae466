"""Training data for drafters: regenerated chat responses, document-aware packing, target hidden states.

Pipeline (all `datasets`, so every stage is cached on disk and memory-mapped):
  responses file -> one example per conversation (`input_ids`, `loss_mask` on response tokens)
  -> packing into fixed-length rows; `position_ids` and `document_ids` restart per document, so attention and RoPE
     never cross a document (the target's packed-sequence mask does the same for the hidden states)
  -> optionally, target hidden states precomputed once into an Arrow cache (offline mode).
"""

from __future__ import annotations

import hashlib
import json
import os

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from transformers.utils import logging

from .regenerate import read_responses


logger = logging.get_logger(__name__)


def conversations_dataset(responses_path: str, max_length: int, sources: list[str] | None = None) -> datasets.Dataset:
    """One example per regenerated conversation: prompt + response ids, loss only on the response.

    `responses_path` may list several files, comma-separated (e.g. chat and code/math responses); `sources`, when
    given, keeps only the records of those sources.
    """
    missing = [path for path in responses_path.split(",") if not os.path.exists(path)]
    if missing:
        raise FileNotFoundError(f"Responses file(s) not found: {', '.join(missing)}; run `angelspec regenerate` first")
    records = read_responses(responses_path)
    if sources is not None:
        records = [record for record in records if record["source"] in sources]
    if not records:
        raise FileNotFoundError(
            f"No regenerated responses{f' of {sources}' if sources else ''} in {responses_path}: run `angelspec regenerate` first"
        )

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


def build_training_dataset(
    responses_path: str, max_length: int, seed: int = 0, sources: list[str] | None = None
) -> datasets.Dataset:
    examples = conversations_dataset(responses_path, max_length, sources).shuffle(seed=seed)
    return pack_documents(examples, max_length)


COMPUTE_DTYPES = ("float32", "bfloat16")
"""The precisions the target may compute cached hidden states in: as loaded, or under bf16 autocast (2.8x faster on
a CPU with AMX; docs/experiments.md, "bf16 for data and training")."""


def check_compute_dtype(compute_dtype: str, name: str = "compute_dtype") -> None:
    """Raise ValueError, naming the argument `name`, unless `compute_dtype` is one of `COMPUTE_DTYPES`."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{name} must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")


@torch.no_grad()
def target_hidden_states(
    target, input_ids: torch.Tensor, position_ids: torch.Tensor, indices: list[int], compute_dtype: str = "float32"
) -> list[torch.Tensor]:
    """The target's hidden states at `indices` for packed rows (no cache, so transformers masks per document). Runs
    the decoder without its LM head: the logits are not needed and cost a fifth of a small target's forward. With
    `compute_dtype="bfloat16"` it runs under bf16 autocast."""
    decoder = target.get_decoder()
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=compute_dtype == "bfloat16"):
        output = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, output_hidden_states=True)
    return [output.hidden_states[i] for i in indices]


def batch_hidden_states(drafter, target, inputs: dict) -> torch.Tensor:
    """[B, N, T, H] of `drafter.training_hidden_state_indices()` for a collated batch: its offline `target_hidden`,
    or computed by `target` (online)."""
    hidden = inputs.get("target_hidden")
    if hidden is None:
        states = target_hidden_states(
            target, inputs["input_ids"], inputs["position_ids"], drafter.training_hidden_state_indices()
        )
        hidden = torch.stack(states, dim=1)
    return hidden.to(drafter.dtype).detach()


HIDDEN_STATE_BOUND = float(torch.finfo(torch.float16).max)
"""Largest |value| a hidden-state cache may hold: float16's range (65504). The default float16 cache cannot hold more
and real LMs stay far below it (even their rare "massive activations" are ~1e3-1e4), so a value beyond it, or one that
is not finite, is damage (a float32 cache overwritten with 1e30, a float16 one with inf or NaN)."""


class UnusableCacheError(Exception):
    """A hidden-state cache that must be recomputed; the message says why."""


def target_fingerprint(target) -> str:
    """sha256 of the target's weights (every state-dict tensor: name, dtype, shape, bytes) and configuration.

    This identifies the target's hidden states whatever the path or name it was loaded from; on SmolLM2-135M in
    float32 (540 MB) it takes about half a second. Config keys that only describe where the weights came from are
    left out: `architectures` and a GGUF file's `quantization_config` (its tensors are de-quantized when loaded), so
    a GGUF target and its conversion to a transformers folder (`load_target`) share their caches.
    """
    digest = hashlib.sha256()
    config = {
        key: value
        for key, value in target.config.to_dict().items()
        if not key.startswith("_") and key not in ("transformers_version", "architectures")
    }
    if str((config.get("quantization_config") or {}).get("quant_method", "")).lower().endswith("gguf"):
        del config["quantization_config"]
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(target.state_dict().items()):
        digest.update(f"{name} {tensor.dtype} {list(tensor.shape)}".encode())
        digest.update(tensor.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def _check_hidden_values(values: np.ndarray, chunk_size: int = 1 << 24) -> None:
    """Raise `UnusableCacheError` if any value is not finite or beyond `HIDDEN_STATE_BOUND`, reading in chunks.

    IEEE floats order like their bits with the sign bit cleared, with inf and NaN above every finite value, so one
    integer maximum per chunk tests both (several times faster than `abs().max()` on float16).
    """
    unsigned = {2: np.uint16, 4: np.uint32, 8: np.uint64}[values.dtype.itemsize]
    magnitude = np.iinfo(unsigned).max >> 1
    limit = np.array(HIDDEN_STATE_BOUND, dtype=values.dtype).view(unsigned)
    bits = values.view(unsigned)
    for start in range(0, len(bits), chunk_size):
        if (bits[start : start + chunk_size] & magnitude).max() > limit:
            raise UnusableCacheError(f"damaged: it holds values that are not finite or beyond ±{HIDDEN_STATE_BOUND:g}")


def _open_hidden_cache(cache_file: str, manifest_file: str, key: dict, num_rows: int) -> datasets.Dataset:
    """The cache at `cache_file`, verified against its manifest (key, file size) and its own contents (rows, shapes,
    values); raises `UnusableCacheError` saying what is wrong."""
    try:
        with open(manifest_file) as handle:
            manifest = json.load(handle)
    except (OSError, ValueError) as error:
        raise UnusableCacheError(f"incomplete: no readable manifest ({error})") from error
    changed = [name for name, value in key.items() if manifest.get(name) != value]
    if changed:
        raise UnusableCacheError(f"stale: computed with a different {' and '.join(changed)}")
    size = os.path.getsize(cache_file) if os.path.exists(cache_file) else 0
    if size != manifest.get("file_size"):
        raise UnusableCacheError(f"truncated or altered: {size} bytes, {manifest.get('file_size')} were written")
    try:
        cached = datasets.Dataset.from_file(cache_file)
    except Exception as error:  # arrow reports a damaged file with many exception types
        raise UnusableCacheError(f"unreadable ({type(error).__name__}: {error})") from error
    _, num_layers, hidden_size = key["shape"]
    feature = datasets.Array3D(shape=(None, num_layers, hidden_size), dtype=key["dtype"])
    if len(cached) != num_rows or cached.features.get("target_hidden") != feature:
        found = cached.features.get("target_hidden")
        raise UnusableCacheError(f"damaged: {len(cached)} rows of {found}, {num_rows} of {feature} expected")
    for batch in cached.data.table.to_batches():
        tokens = batch.column("target_hidden").storage  # list (tokens) of list (layers) of list (features)
        layers = tokens.flatten()
        features = layers.flatten()
        values = features.flatten()
        if any(array.null_count for array in (tokens, layers, features, values)) or not (
            np.array_equal(tokens.value_lengths().to_numpy(), batch.column("input_ids").value_lengths().to_numpy())
            and (layers.value_lengths().to_numpy() == num_layers).all()
            and (features.value_lengths().to_numpy() == hidden_size).all()
        ):
            raise UnusableCacheError(f"damaged: rows do not have the shape [tokens, {num_layers}, {hidden_size}]")
        _check_hidden_values(values.to_numpy())
    return cached


def precompute_hidden_states(
    dataset: datasets.Dataset,
    target,
    indices: list[int],
    cache_dir: str,
    dtype: str = "float16",
    batch_size: int = 4,
    shard_rows: int = 128,
    compute_dtype: str = "float32",
) -> datasets.Dataset:
    """Offline mode: add `target_hidden` ([T, len(indices), H] per row) computed once and memory-mapped from disk,
    stored in `dtype`, computed by the target in `compute_dtype` (`COMPUTE_DTYPES`).

    The rows are cached in shards of `shard_rows` (about ten minutes of SmolLM2 forwards on two cores at 1,024
    tokens per row), each its own cache file, so a long precomputation that is killed resumes at the shard it was
    writing. Each shard is keyed by the target's weights (`target_fingerprint`), its data, the layers tapped and the
    dtypes, in a manifest written last: a write that was killed leaves no manifest. When opened it is verified
    (manifest, file size, rows, shapes, finite values within `HIDDEN_STATE_BOUND`); a stale or damaged shard is
    recomputed, with a warning naming it and what was wrong.
    """
    check_compute_dtype(compute_dtype)
    os.makedirs(cache_dir, exist_ok=True)
    fingerprint = target_fingerprint(target)
    num_shards = max(1, -(-len(dataset) // shard_rows))
    shards = [
        _cached_hidden_states(
            dataset.shard(num_shards, i, contiguous=True) if num_shards > 1 else dataset,
            target,
            fingerprint,
            indices,
            cache_dir,
            dtype,
            batch_size,
            compute_dtype,
        )
        for i in range(num_shards)
    ]
    return (datasets.concatenate_datasets(shards) if num_shards > 1 else shards[0]).with_format("torch")


def _cached_hidden_states(
    dataset: datasets.Dataset,
    target,
    fingerprint: str,
    indices: list[int],
    cache_dir: str,
    dtype: str,
    batch_size: int,
    compute_dtype: str,
) -> datasets.Dataset:
    """`dataset` with `target_hidden`, from its verified cache file or computed into one (see `precompute_hidden_states`)."""
    hidden_size = target.config.get_text_config().hidden_size
    key = {
        "target_sha256": fingerprint,
        "data_fingerprint": dataset._fingerprint,
        "indices": list(indices),
        "dtype": dtype,
        "shape": [None, len(indices), hidden_size],
    }
    # One cache per target name and data: a target whose weights changed at the same path replaces its stale cache.
    name = [target.config.name_or_path, dataset._fingerprint, list(indices), dtype]
    if compute_dtype != "float32":  # caches computed as loaded keep the names and keys they had before this option
        key["compute_dtype"] = compute_dtype
        name.append(compute_dtype)
    name = json.dumps(name)
    stem = os.path.join(cache_dir, f"hidden-{hashlib.sha256(name.encode()).hexdigest()[:16]}")
    cache_file, manifest_file = f"{stem}.arrow", f"{stem}.json"
    if os.path.exists(cache_file) or os.path.exists(manifest_file):
        try:
            return _open_hidden_cache(cache_file, manifest_file, key, len(dataset))
        except UnusableCacheError as problem:
            logger.warning(f"Hidden-state cache {cache_file} is {problem}; recomputing it.")
            if os.path.exists(manifest_file):
                os.remove(manifest_file)  # it must not vouch for a replacement that is not written yet

    features = dataset.features.copy()
    features["target_hidden"] = datasets.Array3D(shape=(None, len(indices), hidden_size), dtype=dtype)
    torch_dtype = getattr(torch, dtype)

    def add_hidden(batch):
        out = []
        for ids, positions in zip(batch["input_ids"], batch["position_ids"]):
            states = target_hidden_states(
                target, torch.tensor([ids]), torch.tensor([positions]), indices, compute_dtype
            )
            hidden = torch.stack([s[0] for s in states], dim=1).to(torch_dtype)
            if not hidden.abs().amax() <= HIDDEN_STATE_BOUND:
                raise ValueError(
                    f"The target's hidden states reach {hidden.abs().amax().item():g} in {dtype}, beyond the cache's "
                    f"bound ±{HIDDEN_STATE_BOUND:g}: train this target with online hidden states"
                )
            out.append(hidden.numpy())
        return {"target_hidden": out}

    cached = dataset.map(  # datasets writes a temporary file and moves it into place when complete
        add_hidden,
        batched=True,
        batch_size=batch_size,
        features=features,
        cache_file_name=cache_file,
        load_from_cache_file=False,
        new_fingerprint=hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32],
        desc="target hidden states",
    )
    manifest = {**key, "rows": len(cached), "file_size": os.path.getsize(cache_file)}
    with open(f"{manifest_file}.tmp", "w") as handle:
        json.dump(manifest, handle, indent=1)
    os.replace(f"{manifest_file}.tmp", manifest_file)
    return cached


class PackedCollator:
    """Pad packed rows to the longest in the batch; padding is its own document with no loss.

    `select`: positions, in the cached `target_hidden` layers, of the ones the drafter reads (a cache of more layers,
    e.g. low, middle, high and final, then serves drafters that tap any of them without recomputing).
    """

    PAD_VALUES = {"input_ids": 0, "loss_mask": 0, "document_ids": -1}

    def __init__(self, select: list[int] | None = None):
        self.select = select

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(row["input_ids"]) for row in rows)
        batch = {}
        for key, value in self.PAD_VALUES.items():
            batch[key] = torch.stack(
                [F.pad(torch.as_tensor(row[key]), (0, width - len(row[key])), value=value) for row in rows]
            )
        # Padding positions count up from 0 like a document of their own.
        batch["position_ids"] = torch.stack(
            [
                torch.cat([torch.as_tensor(row["position_ids"]), torch.arange(width - len(row["position_ids"]))])
                for row in rows
            ]
        )
        if "target_hidden" in rows[0]:  # stored [T, N, H]; the drafter reads [B, N, T, H]
            hidden = [torch.as_tensor(row["target_hidden"]) for row in rows]
            if self.select is not None:
                hidden = [states[:, self.select] for states in hidden]
            batch["target_hidden"] = torch.stack(
                [F.pad(states, (0, 0, 0, 0, 0, width - len(states))) for states in hidden]
            ).transpose(1, 2)
        return batch
