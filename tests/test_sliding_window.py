"""Targets whose layers attend to a sliding window: every batched path (the engine, `generate()` on a batch) counts
the window in each row's own positions, so its output equals plain decoding (the sampled law: tests/test_engine.py's
χ² test runs on windowed targets too)."""

import random

import pytest
import torch
from conftest import make_target
from test_engine import flat_cost_model, make_drafter, solo_outputs

from angelspec_hf import RouterDrafter, SuffixDrafter
from angelspec_hf.cache_utils import RaggedCache, sliding_windows
from angelspec_hf.generation.engine import Request, SpeculativeEngine


WINDOW = 8


def windowed_target(model_type: str, **overrides):
    """Mistral: every layer windowed; Qwen2: the first of three layers full, the others windowed (layer_types)."""
    if model_type == "mistral":
        return make_target("mistral", sliding_window=WINDOW, **overrides)
    return make_target(
        "qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **overrides
    )


def long_requests(vocab_size, count=6, seed=0):
    """Prompts of 9 to 30 tokens (longer than the window) and 12 to 30 new tokens."""
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(vocab_size - 1) for _ in range(rng.choice([9, 14, 30]))],
            max_new_tokens=rng.choice([12, 20, 30]),
            request_id=index,
        )
        for index in range(count)
    ]


def test_the_window_is_read_from_the_config():
    assert sliding_windows(make_target("llama").config) is None
    assert sliding_windows(make_target("mistral", sliding_window=None).config) is None
    assert sliding_windows(make_target("mistral").config) == {"all": 4096}  # Mistral's default window
    assert sliding_windows(windowed_target("mistral").config) == {"all": WINDOW}
    assert sliding_windows(windowed_target("qwen2").config) == {"sliding_attention": WINDOW}


def test_the_window_counts_a_rows_positions_not_its_columns():
    """Row 0 holds tokens at columns 0-5 with a hole at column 2; row 1 joined later (columns 0-2 padding)."""
    cache = RaggedCache(2)
    cache.append(torch.tensor([[1, 1, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool))
    mask = cache.attention_mask(1, window=3)[:, 0, 0]  # the last column as query
    assert mask[0].tolist() == [False, False, False, True, True, True]  # positions 2, 3, 4 (the hole not counted)
    assert mask[1].tolist() == [False, False, False, True, True, True]
    mask = cache.attention_mask(1, window=4)[:, 0, 0]
    assert mask[0].tolist() == [False, True, False, True, True, True]  # position 1 is column 1: in the window


@pytest.mark.parametrize(
    "model_type, kind",
    [(m, k) for m in ("mistral", "qwen2") for k in (None, "suffix", "mtp", "dfly")] + [("mistral", "router")],
)
def test_the_engine_matches_plain_decoding_on_a_windowed_target(model_type, kind, dcut_always_drafts):
    target = windowed_target(model_type)
    requests = long_requests(target.config.vocab_size, seed=1)
    references = solo_outputs(target, requests)
    if kind == "suffix":
        drafter = SuffixDrafter.from_target(target, shared_index_max_tokens=0)
    elif kind == "router":
        members = [make_drafter("mtp", target, oracle=False), SuffixDrafter.from_target(target)]
        drafter = RouterDrafter.from_members(members)
    elif kind is not None:
        drafter = make_drafter(kind, target, oracle=False)
    else:
        drafter = None
    policy = "constant-3" if kind in ("suffix", "router") else "dcut"
    engine = SpeculativeEngine(target, drafter, policy=policy, max_batch_size=3, cost_model=flat_cost_model())
    outputs = engine.generate(requests)
    assert [o.output_ids for o in outputs] == [references[r.request_id] for r in requests]
    assert max(len(r.input_ids) + len(o.output_ids) for r, o in zip(requests, outputs)) > 3 * WINDOW


def test_the_engine_matches_plain_decoding_with_drafts_accepted_on_a_windowed_target(dcut_always_drafts):
    """The suffix drafter on repetitive prompts: many drafts accepted, rows ragged, holes in the cache."""
    target = windowed_target("mistral")
    pattern = [7, 8, 9, 10, 11, 12]
    requests = [Request(pattern * 4 + [5 + i], max_new_tokens=30, request_id=i) for i in range(4)]
    references = solo_outputs(target, requests)
    drafter = SuffixDrafter.from_target(target, shared_index_max_tokens=0)
    engine = SpeculativeEngine(target, drafter, policy="constant-4", max_batch_size=4, cost_model=flat_cost_model())
    outputs = engine.generate(requests)
    assert [o.output_ids for o in outputs] == [references[r.request_id] for r in requests]


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_generate_with_a_left_padded_batch_on_a_windowed_target(model_type):
    target = windowed_target(model_type)
    drafter = make_drafter("mtp", target, oracle=False)
    prompts = [list(range(5, 25)), [11, 12], list(range(30, 41))]
    width = max(map(len, prompts))
    pad = target.config.pad_token_id
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    output = target.generate(batch, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    for row, prompt in enumerate(prompts):
        solo = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt) :].tolist()
        generated = output[row, width:].tolist()
        assert generated[: len(solo)] == solo and set(generated[len(solo) :]) <= {pad}, f"row {row}"
