"""A KV cache shared by rows of different lengths: how a batch with ragged acceptance stays on one tensor.

Speculative rounds accept a different number of tokens in every row. Instead of re-laying the cache out after each
round, all rows share the same columns and a per-row validity mask says which columns hold real tokens: a rejected
draft becomes a masked hole, a row that joined later is masked on the left. Keys carry their rotary position from
the moment they were written, so holes change nothing but the mask; position ids are tracked per row (`lengths`).
`compact()` squeezes the holes out once they waste more than half the columns.

transformers' `DynamicCache` stores the tensors (the model's own layers update it); this class only tracks
validity and does the row surgery (drop finished rows, append joining rows) that a fixed-batch cache lacks. Its
layers (`GrowingLayer`) keep keys and values in buffers with spare rows and columns, so a forward's new columns,
rows joining and rows leaving are written in place instead of copying the whole cache.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@functools.cache
def cache_argument() -> str:
    """The keyword models, decoder layers and attention modules take their cache by: `cache` from transformers 5.25
    on (`past_key_values` is deprecated there, to be removed in 5.40), `past_key_values` before. Read on first use:
    importing a model module at this module's import would run transformers' Auto lookups, which import the
    drafters, which import this module."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return "cache" if "cache" in inspect.signature(LlamaDecoderLayer.forward).parameters else "past_key_values"


def with_cache(cache) -> dict:
    """`{cache_argument(): cache}`, for a model, decoder layer or attention call under this transformers."""
    return {cache_argument(): cache}


def ragged_valid(lengths: torch.LongTensor | None, batch_size: int, count: int, device) -> torch.Tensor:
    """[B, count] mask of the real columns of a right-padded chunk (all real when `lengths` is None)."""
    if lengths is None:
        return torch.ones(batch_size, count, dtype=torch.bool, device=device)
    return torch.arange(count, device=device)[None, :] < lengths.to(device)[:, None]


def sliding_windows(config) -> dict[str, int] | None:
    """The sliding window of a target whose layers (some or all) attend to a window: `{"sliding_attention": W}`
    for a config whose `layer_types` mix kinds (Qwen2 / Qwen3 with `use_sliding_window`), `{"all": W}` when every
    layer is windowed (Mistral's `sliding_window`), None for full attention everywhere."""
    config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    if layer_types is None or set(layer_types) == {"sliding_attention"}:
        return {"all": window}
    return {"sliding_attention": window}


def pad_pending(
    tokens: list[list[int]], hidden: list[list[tuple[torch.Tensor, ...]]], num_taps: int, device
) -> tuple[torch.LongTensor, torch.LongTensor, tuple[torch.Tensor, ...]]:
    """Rows' verified tokens not yet read by a drafter, and their target states (per row, one chunk per verify round,
    one tensor per tap), as a right-padded batch: token ids [B, W], lengths [B], and one [B, W, H] tensor per tap."""
    width = max(len(row) for row in tokens)
    lengths = torch.tensor([len(row) for row in tokens], device=device)
    ids = torch.tensor([row + [0] * (width - len(row)) for row in tokens], dtype=torch.long, device=device)
    states = tuple(
        torch.stack(
            [
                torch.nn.functional.pad(torch.cat([chunk[t] for chunk in chunks]), (0, 0, 0, width - len(row)))
                for row, chunks in zip(tokens, hidden)
            ]
        )
        for t in range(num_taps)
    )
    return ids, lengths, states


def last_valid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, ...]: each row's entry at its last real column of a right-padded chunk."""
    index = valid.long().sum(1).sub(1).clamp(min=0).view(-1, 1, *([1] * (values.dim() - 2)))
    return values.gather(1, index.expand(-1, 1, *values.shape[2:]))


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are the first rows and columns of larger buffers. A forward's new columns
    are written into spare columns, where `DynamicLayer` concatenates (copies) the whole cache at every forward, the
    largest single cost of a batched engine step (docs/experiments.md, "Regeneration"). Rows leaving or joining the
    batch are moved or written in place too: only the rows that change slot are copied, not the batch. Keys and
    values set from outside (a compaction, a merge that did not fit) are taken as they are and get buffers at the
    next write; a crop keeps the buffers, so the next write reuses the cropped columns."""

    spare_columns = 64

    def __init__(self):
        super().__init__()
        self.row_capacity = 0  # the most rows this layer has held: its buffers keep room for as many

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys.dim() != 4:
            return super().update(key_states, value_states, *args, **kwargs)
        rows, width, new = self.keys.shape[0], self.keys.shape[2], key_states.shape[2]
        if not self.holds(rows, width + new):
            self._reserve(width + new)
        self._key_buffer[:rows, :, width : width + new] = key_states
        self._value_buffer[:rows, :, width : width + new] = value_states
        self._view(rows, width + new)
        return self.keys, self.values

    def holds(self, rows: int, width: int) -> bool:
        """Are the keys and values the first rows and columns of this layer's buffers, which have room for `rows`
        rows of `width` columns?"""
        buffers = getattr(self, "_key_buffer", None), getattr(self, "_value_buffer", None)
        return all(
            buffer is not None
            and current.data_ptr() == buffer.data_ptr()
            and current.stride() == buffer.stride()
            and current.shape[1] == buffer.shape[1]
            and rows <= buffer.shape[0]
            and width <= buffer.shape[2]
            for current, buffer in zip((self.keys, self.values), buffers)
        )

    def keep_rows(self, rows: torch.LongTensor) -> None:
        """Keep only `rows` (in that order): row `rows[i]` moves to slot i. In the buffers, only the rows whose slot
        changes are copied (a row-leaving order that fills each freed slot from the end moves one row per leaver)."""
        width = self.keys.shape[2]
        if not self.holds(self.keys.shape[0], width):
            self.keys, self.values = self.keys[rows], self.values[rows]
            return
        slots = torch.arange(len(rows), device=rows.device)
        moved = rows != slots
        if moved.any():
            sources, targets = rows[moved], slots[moved]
            for buffer in (self._key_buffer, self._value_buffer):
                buffer[targets, :, :width] = buffer[sources, :, :width]  # the source rows are gathered first
        self._view(len(rows), width)

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write joining rows (as wide as the cache) below the current ones, in the buffers' spare rows (the caller
        checks `holds(rows + joining, width)` first)."""
        rows, width = self.keys.shape[0], self.keys.shape[2]
        self._key_buffer[rows : rows + keys.shape[0], :, :width] = keys
        self._value_buffer[rows : rows + keys.shape[0], :, :width] = values
        self._view(rows + keys.shape[0], width)

    def nbytes(self) -> int:
        """Bytes this layer holds: its buffers where the keys and values live in them."""
        held = (self._key_buffer, self._value_buffer) if self.holds(self.keys.shape[0], self.keys.shape[2]) else ()
        return sum(t.numel() * t.element_size() for t in held or (self.keys, self.values))

    def _view(self, rows: int, width: int) -> None:
        self.keys = self._key_buffer[:rows, :, :width]
        self.values = self._value_buffer[:rows, :, :width]

    def _reserve(self, width: int) -> None:
        """New buffers with room for the most rows this layer has held and `width` columns plus spare ones, holding
        the current keys and values."""
        rows = self.keys.shape[0]
        self.row_capacity = max(self.row_capacity, rows)
        self._key_buffer, self._value_buffer = (
            self._with_room(tensor, self.row_capacity, width) for tensor in (self.keys, self.values)
        )

    def _with_room(self, tensor: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        buffer = tensor.new_empty(rows, tensor.shape[1], width + self.spare_columns, tensor.shape[-1])
        buffer[: tensor.shape[0], :, : tensor.shape[2]] = tensor
        return buffer


def growing_cache() -> DynamicCache:
    """A `DynamicCache` of `GrowingLayer`s (its layers are made as the model first writes them)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def fewest_moves(keep: list[int]) -> list[int]:
    """The surviving rows `keep` (ascending) in the order that moves fewest of them when the others leave: a survivor
    in the first `len(keep)` slots stays where it is, and each slot freed there is filled by a survivor from the end."""
    count, survivors = len(keep), set(keep)
    from_the_end = iter(row for row in keep if row >= count)
    return [row if row in survivors else next(from_the_end) for row in range(count)]


class RaggedCache:
    """A `DynamicCache` plus `valid` [B, W]: whether column c of row r holds a token of that row's sequence."""

    def __init__(self, batch_size: int, device: torch.device | str = "cpu"):
        self.cache = growing_cache()
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    @property
    def lengths(self) -> torch.LongTensor:
        """Tokens held per row: the position id of each row's next token."""
        return self.valid.sum(1)

    def append(self, new_valid: torch.Tensor) -> None:
        """Register `new_valid.shape[1]` columns about to be written by a forward (False: a hole from the start)."""
        self.valid = torch.cat([self.valid, new_valid.to(self.valid.device, torch.bool)], dim=1)

    def attention_mask(self, count: int, causal: bool = True, window: int | None = None) -> torch.Tensor:
        """Boolean attention mask [B, 1, count, W] (True = attend) of the last `count` columns as queries. A query sees
        the valid keys of its row, earlier columns only if `causal`, only the last `window` positions of its row when
        a sliding window is given (positions counted per row, holes skipped: not columns), and always itself, so no
        query row is empty (an empty row would turn the padding's keys into NaN)."""
        keys = torch.arange(self.width, device=self.valid.device)
        queries = torch.arange(count, device=self.valid.device)[:, None] + self.width - count
        order = (
            keys[None, :] <= queries if causal else torch.ones(count, self.width, dtype=torch.bool, device=keys.device)
        )
        mask = self.valid[:, None, None, :] & order
        if window is not None:
            positions = self.valid.long().cumsum(1) - 1  # [B, W]: the row position of each valid column
            mask = mask & (positions[:, None, -count:, None] - positions[:, None, None, :] < window)
        return mask | (keys[None, :] == queries)

    def target_attention_mask(self, count: int, windows: dict[str, int] | None, dtype: torch.dtype):
        """The target's attention mask for a forward of `count` new columns: the 2D validity when every layer attends
        to the full context (transformers builds the causal mask from it), else additive 4D masks that count the
        sliding window in each row's own positions (transformers would count columns, holes and padding included):
        one tensor when every layer is windowed, else one per layer kind (`sliding_windows`)."""
        if windows is None:
            return self.valid.long()

        def additive(mask):
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

        if "all" in windows:
            return additive(self.attention_mask(count, window=windows["all"]))
        return {
            "full_attention": additive(self.attention_mask(count)),
            "sliding_attention": additive(self.attention_mask(count, window=windows["sliding_attention"])),
        }

    def position_ids(self, count: int, offset: int = 0) -> torch.LongTensor:
        """[B, count] positions of `count` new tokens per row (before `append` registers them)."""
        return self.lengths[:, None] + offset + torch.arange(count, device=self.valid.device)

    def keep_last(self, keep: torch.Tensor) -> None:
        """After verification: of the last `keep.shape[1]` columns, only those marked in `keep` [B, n] stay valid."""
        self.valid[:, -keep.shape[1] :] &= keep.to(self.valid.device, torch.bool)

    def crop(self, count: int) -> None:
        """Drop the last `count` columns of every row."""
        if count > 0:
            self.cache.crop(-count)
            self.valid = self.valid[:, :-count]

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keep only `rows` (in that order): finished requests leave the batch."""
        if not rows.numel():  # nobody left: start afresh
            self.cache, self.valid = growing_cache(), self.valid.new_zeros(0, 0)
            return
        rows = rows.to(self.valid.device)
        for layer in self.written_layers():  # not `DynamicCache.batch_select_indices`: it skips zero-column layers
            layer.keep_rows(rows)
        self.valid = self.valid[rows]

    def copy(self) -> "RaggedCache":
        """An independent copy, every tensor cloned (a kept prefill handed to another request)."""
        twin = RaggedCache(0, self.valid.device)
        twin.valid = self.valid.clone()
        for index, layer in enumerate(self.written_layers()):
            twin.cache.update(layer.keys.clone(), layer.values.clone(), index)
        return twin

    def split_rows(self, rows: torch.LongTensor) -> "RaggedCache":
        """Move `rows` (in that order) out into a cache of their own; this one keeps its other rows, in order."""
        rows = rows.to(self.valid.device)
        part = RaggedCache(0, self.valid.device)
        part.valid = self.valid[rows]
        for index, layer in enumerate(self.written_layers()):
            part.cache.update(layer.keys[rows], layer.values[rows], index)
        others = torch.ones(self.batch_size, dtype=torch.bool, device=self.valid.device)
        others[rows] = False
        self.select_rows(others.nonzero()[:, 0])
        return part

    def append_rows(self, *others: "RaggedCache") -> None:
        """Add the rows of `others` (joining requests) below ours, left-padding the narrower ones with holes, in one
        copy per layer however many join. A cache without tensors yet (nothing written) contributes all-hole rows."""
        parts = [cache for cache in (self, *others) if cache.batch_size]
        if self._append_in_place(parts[1:] if self.batch_size else ()):
            return
        if len(parts) <= 1:
            if parts:
                self.cache, self.valid = parts[0].cache, parts[0].valid
            return
        width = max(cache.width for cache in parts)
        tensors = self._padded_tensors(parts, width)
        if tensors is not None:
            holder = next(cache for cache in parts if cache.written_layers())
            for index, layer in enumerate(holder.written_layers()):  # the holder's layer objects carry on
                layer.keys = torch.cat([t[index][0] for t in tensors], dim=0)
                layer.values = torch.cat([t[index][1] for t in tensors], dim=0)
            self.cache = holder.cache
        self.valid = torch.cat([cache.pad_left(width) for cache in parts], dim=0)

    def _append_in_place(self, others: list["RaggedCache"]) -> bool:
        """`append_rows` without copying the batch: when no joining row is wider than the cache and the layers'
        buffers have spare rows, the joining rows (left-padded with holes) are written into them. False, and nothing
        changed, otherwise."""
        layers = self.written_layers()
        if not others or not layers or any(cache.width > self.width for cache in others):
            return False
        count = sum(cache.batch_size for cache in others)
        if not all(layer.holds(layer.keys.shape[0] + count, self.width) for layer in layers):
            return False
        tensors = self._padded_tensors(others, self.width, [(layer.keys, layer.values) for layer in layers])
        for index, layer in enumerate(layers):
            layer.append_rows(*(torch.cat([t[index][i] for t in tensors]) for i in (0, 1)))
        self.valid = torch.cat([self.valid, *(cache.pad_left(self.width) for cache in others)], dim=0)
        return True

    @staticmethod
    def _padded_tensors(caches: list["RaggedCache"], width: int, template=None) -> list | None:
        """Each cache's per-layer (keys, values), left-padded with holes to `width`; a cache with nothing written yet
        gets zeros shaped like `template`'s layers (default: the first written cache's). None when there is neither.
        Caches of different layer counts are refused."""
        tensors = [cache.tensors(width) for cache in caches]
        written = [t for t in tensors if t]
        template = template or (written[0] if written else None)
        if template is None:
            return None
        if any(len(t) != len(template) for t in written):
            raise ValueError(f"Cannot merge caches of {sorted({len(t) for t in written} | {len(template)})} layers")
        return [
            t or [tuple(x.new_zeros(cache.batch_size, *x.shape[1:]) for x in pair) for pair in template]
            for cache, t in zip(caches, tensors)
        ]

    def compact(self, max_waste: float = 0.5) -> None:
        """Squeeze out the holes once that frees more than `max_waste` of the columns: each row's tokens, in order,
        move to its last `lengths[r]` columns (left-padded to the longest row). Holes that only left-pad shorter
        rows cannot be freed, so they never trigger the copy."""
        width = int(self.lengths.max()) if self.batch_size else 0
        if not self.width or width >= (1 - max_waste) * self.width:
            return
        # A stable sort of the 0/1 validity puts each row's holes first and keeps its tokens in order.
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, self.width - width :]
        for layer in self.written_layers():
            index = order[:, None, :, None].to(layer.keys.device)
            layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1]))
            layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[-1]))
        self.valid = self.valid.gather(1, order)

    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return sum(layer.nbytes() for layer in self.written_layers())

    # -- helpers ------------------------------------------------------------------------------------------------------

    def written_layers(self) -> list:
        """The cache layers that hold [B, heads, columns, dim] tensors (a layer is created empty and filled by the
        first forward). Zero columns still count: such a layer has a batch size that row surgery must keep right."""
        return [
            layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4
        ]

    def tensors(self, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each written layer's (keys, values), left-padded with zero columns to `width`."""
        out = []
        for layer in self.written_layers():
            pad = width - layer.keys.shape[2]
            out.append(tuple(torch.nn.functional.pad(t, (0, 0, pad, 0)) for t in (layer.keys, layer.values)))
        return out

    def pad_left(self, width: int) -> torch.Tensor:
        """`valid` padded on the left with holes to `width` columns."""
        return torch.cat([self.valid.new_zeros(self.batch_size, width - self.width), self.valid], dim=1)
