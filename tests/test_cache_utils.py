"""`RaggedCache`: rows of different lengths on one cache tensor, holes squeezed out, rows joining and leaving."""

import torch

from angelspec_hf.cache_utils import RaggedCache


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
