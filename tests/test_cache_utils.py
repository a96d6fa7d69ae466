"""`RaggedCache`: rows of different lengths on one cache tensor, holes squeezed out, rows joining and leaving."""

import torch

from angelspec_hf.cache_utils import RaggedCache, fewest_moves


def test_ragged_cache_compaction_keeps_every_rows_tokens_in_order():
    cache = RaggedCache(2)
    layer_keys = torch.arange(2 * 8, dtype=torch.float64).view(2, 1, 8, 1)
    cache.cache.update(layer_keys, layer_keys.clone(), 0)
    cache.append(torch.tensor([[1, 0, 1, 0, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool))
    cache.compact()
    assert cache.width == 3
    assert cache.valid.tolist() == [[True, True, True], [False, True, True]]
    assert cache.cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 2, 7]
    assert cache.cache.layers[0].keys[1, 0, 1:, 0].tolist() == [8, 9]


def test_ragged_cache_does_not_copy_for_holes_it_cannot_free():
    """Left padding of a short row next to a long one is not waste compaction can remove: no copy."""
    cache = RaggedCache(2)
    keys = torch.zeros(2, 1, 8, 1)
    cache.cache.update(keys, keys.clone(), 0)
    cache.append(torch.tensor([[1] * 8, [0] * 7 + [1]], dtype=torch.bool))
    before = cache.cache.layers[0].keys
    cache.compact()
    assert cache.cache.layers[0].keys is before and cache.width == 8


def test_ragged_cache_rows_joining_and_leaving_a_cache_compacted_to_no_columns():
    """Rows that never wrote a token (their drafter has not run yet) left alone in the cache: compaction leaves zero
    columns, and rows joining or leaving afterwards must still change the tensors' batch, or the next write cannot
    fit (the full suite's engine run crashed so)."""
    cache = RaggedCache(2)
    keys = torch.zeros(2, 1, 4, 1)
    cache.cache.update(keys, keys.clone(), 0)
    cache.append(torch.zeros(2, 4, dtype=torch.bool))
    cache.compact()
    assert cache.width == 0 and cache.cache.layers[0].keys.shape == (2, 1, 0, 1)
    cache.append_rows(RaggedCache(3))
    assert cache.batch_size == 5 and cache.cache.layers[0].keys.shape == (5, 1, 0, 1)
    cache.select_rows(torch.tensor([0, 2, 4]))  # and rows leaving it must shrink it
    assert cache.batch_size == 3 and cache.cache.layers[0].keys.shape == (3, 1, 0, 1)
    cache.cache.update(torch.ones(3, 1, 2, 1), torch.ones(3, 1, 2, 1), 0)  # the next forward writes every row
    assert cache.cache.layers[0].keys.shape == (3, 1, 2, 1)


def _filled(rows: int, width: int, start: float = 0.0) -> RaggedCache:
    """A cache of `rows` rows whose keys number their (row, column) cells, written by two forwards (so the second
    lands in a growing layer's buffers), values the negated keys."""
    cache = RaggedCache(rows)
    keys = torch.arange(rows * width, dtype=torch.float64).view(rows, 1, width, 1) + start
    for part in (keys[:, :, : width // 2], keys[:, :, width // 2 :]):
        cache.cache.update(part, -part, 0)
    cache.append(torch.ones(rows, width, dtype=torch.bool))
    return cache


def test_rows_leaving_and_joining_move_only_the_rows_that_change_slot():
    """Leavers free slots that survivors from the end fill (`fewest_moves`); joiners narrower than the batch are
    written into the buffers' spare rows, left-padded with holes: the batch's tensors are never re-allocated."""
    cache = _filled(6, 8)
    layer = cache.cache.layers[0]
    before, buffer = layer.keys.clone(), layer.keys.data_ptr()
    order = fewest_moves([0, 2, 3, 5])
    assert order == [0, 5, 2, 3]
    cache.select_rows(torch.tensor(order))
    assert layer.keys.data_ptr() == buffer and torch.equal(layer.keys, before[order])
    assert torch.equal(layer.values, -before[order])

    joining = _filled(1, 5, start=100.0)
    cache.append_rows(joining, RaggedCache(1))  # a prefilled row and a row its drafter has not written yet
    assert layer.keys.data_ptr() == buffer and cache.batch_size == 6
    assert torch.equal(layer.keys[:4], before[order])
    assert layer.keys[4, 0, :, 0].tolist() == [0, 0, 0, 100, 101, 102, 103, 104]
    assert layer.keys[5].abs().sum() == 0
    assert cache.valid[4].tolist() == [False] * 3 + [True] * 5 and not cache.valid[5].any()

    cache.cache.update(torch.ones(6, 1, 1, 1), torch.ones(6, 1, 1, 1), 0)  # the next forward writes in place too
    assert layer.keys.data_ptr() == buffer and layer.keys.shape == (6, 1, 9, 1)


def test_rows_joining_beyond_the_buffers_room_are_merged_by_one_copy():
    """A joining row wider than the batch, or more rows than the buffers hold: the batch is re-laid out (left-padded
    to the widest row), and the next forward gives it buffers with room for that many rows."""
    cache = _filled(2, 4)
    cache.append_rows(_filled(1, 6, start=50.0))
    layer = cache.cache.layers[0]
    assert layer.keys[:, 0, :, 0].tolist() == [[0, 0, 0, 1, 2, 3], [0, 0, 4, 5, 6, 7], [50, 51, 52, 53, 54, 55]]
    assert cache.valid.sum(1).tolist() == [4, 4, 6]
    cache.append(torch.ones(3, 1, dtype=torch.bool))
    cache.cache.update(torch.zeros(3, 1, 1, 1), torch.zeros(3, 1, 1, 1), 0)
    cache.select_rows(torch.tensor([2]))
    cache.append_rows(_filled(2, 3))  # three rows again: within the room of the buffers made for three
    assert layer.holds(3, 7) and layer.keys[:, 0, :, 0].tolist()[0] == [50, 51, 52, 53, 54, 55, 0]
