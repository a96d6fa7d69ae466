"""Speculative decoding through `target.generate(assistant_model=drafter)` is lossless."""

import os
import random

import pytest
import torch
import transformers
from conftest import ARCHITECTURES, make_target
from oracles import OracleMTPDrafter
from transformers import TextIteratorStreamer
from transformers.generation.candidate_generator import AssistedCandidateGenerator, PromptLookupCandidateGenerator
from transformers.generation.utils import GenerationMixin

import angelspec_hf
from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter, SuffixDrafter
from angelspec_hf.generation import AngelSpecCandidateGenerator, policies
from angelspec_hf.generation.verify_cost import VerifyCostModel


def random_prompt(length, vocab_size, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size - 1, (1, length), generator=generator)


@pytest.mark.parametrize("loop", ["engine", "transformers"])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_greedy_output_equals_plain_decoding_for_every_architecture(model_type, loop, request):
    if loop == "transformers":
        request.getfixturevalue("on_transformers_loop")
    target = make_target(model_type)
    drafter = OracleMTPDrafter.from_target(target, num_depths=3, draft_vocab_size=48)
    drafter.rng = random.Random(0)
    accepted = 0
    for seed, (prompt_length, new_tokens) in enumerate([(1, 17), (5, 40), (23, 64), (3, 2), (60, 31), (9, 1)]):
        prompt = random_prompt(prompt_length, target.config.vocab_size, seed)
        reference = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        drafter.reference = reference
        output = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)
        assert torch.equal(output, reference), f"{model_type}: prompt {seed} diverged"
        accepted += sum(drafter.speculation_stats.accepted)
    assert accepted > 20, "the oracle should have made many drafts acceptable"


@pytest.mark.parametrize("schedule", ["dcut", "heuristic"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_adaptive_schedules_are_lossless_and_vary_the_verified_depth(
    model_type, schedule, monkeypatch, dcut_always_drafts
):
    """D-cut (against a cost model where each verified token costs a third of a forward) and the heuristic
    schedule verify varied depths; the output stays plain greedy decoding."""
    linear_cost = VerifyCostModel(rows=[1], tokens=[1, 4], seconds=[[1.0, 2.0]], context=0)
    monkeypatch.setattr(policies, "load_cost_model", lambda target, rows=(1,): linear_cost)
    target = make_target(model_type, seed=6)
    drafter = OracleMTPDrafter.from_target(target, num_depths=3, draft_vocab_size=48)
    drafter.generation_config.num_assistant_tokens_schedule = schedule
    drafter.rng, drafter.random_confidence = random.Random(4), True
    depths = set()
    for seed, (prompt_length, new_tokens) in enumerate([(4, 40), (17, 33), (2, 25)]):
        prompt = random_prompt(prompt_length, target.config.vocab_size, 20 + seed)
        reference = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        drafter.reference = reference
        output = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)
        assert torch.equal(output, reference), f"{model_type}/{schedule}: prompt {seed} diverged"
        depths.update(drafter.speculation_stats.drafted)
    assert len(depths) >= 3, f"{schedule} should verify varied depths, saw {sorted(depths)}"


def test_unknown_schedule_is_refused():
    target = make_target("llama")
    drafter = AngelSpecMTPDrafter.from_target(target)
    drafter.generation_config.num_assistant_tokens_schedule = "heuristic_transient"
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        target.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, assistant_model=drafter)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_untrained_drafter_is_still_lossless_with_full_vocabulary(model_type):
    target = make_target(model_type, seed=3)
    drafter = AngelSpecMTPDrafter.from_target(target, num_depths=2)
    for seed in range(4):
        prompt = random_prompt(4 + 5 * seed, target.config.vocab_size, seed)
        reference = target.generate(prompt, max_new_tokens=25, do_sample=False)
        output = target.generate(prompt, max_new_tokens=25, do_sample=False, assistant_model=drafter)
        assert torch.equal(output, reference)


def test_draft_cache_holds_exactly_the_verified_prefix(on_transformers_loop):
    """After a generation with mixed acceptance on transformers' loop, the incremental draft cache equals one forward
    over the sequence (the engine's: `test_engine.py`)."""
    target = make_target("llama", seed=5)
    drafter = OracleMTPDrafter.from_target(target, num_depths=3)
    drafter.rng = random.Random(1)
    prompt = random_prompt(11, target.config.vocab_size, 7)
    drafter.reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
    sequence = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    state = drafter.last_state
    verified = state.num_committed
    hidden = target(sequence, output_hidden_states=True).hidden_states[-1]
    positions = torch.arange(1, verified + 1)[None]
    fresh = drafter.step(hidden[:, :verified], sequence[:, 1 : verified + 1], positions, use_cache=True)
    incremental_keys = state.cache.cache.layers[0].keys[:, :, :verified]
    torch.testing.assert_close(incremental_keys, fresh.past_key_values.layers[0].keys)


def test_custom_generate_entry_point_matches_assistant_model():
    target = make_target("qwen2", seed=2)
    drafter = AngelSpecMTPDrafter.from_target(target, num_depths=3, draft_vocab_size=40)
    prompt = random_prompt(8, target.config.vocab_size, 1)
    via_assistant = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    via_custom = target.generate(
        prompt, max_new_tokens=30, do_sample=False, custom_generate=angelspec_hf.speculative_generate, drafter=drafter
    )
    assert torch.equal(via_assistant, via_custom)
    assert torch.equal(via_assistant, target.generate(prompt, max_new_tokens=30, do_sample=False))


def test_eos_max_new_tokens_and_return_dict_behave_as_plain_generate():
    target = make_target("mistral", seed=4)
    drafter = OracleMTPDrafter.from_target(target, num_depths=3)
    drafter.rng = random.Random(2)
    prompt = random_prompt(6, target.config.vocab_size, 3)
    free_run = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None)
    eos = int(free_run[0, 6 + 12])  # a token the target emits mid-way becomes EOS
    kwargs = dict(
        max_new_tokens=30, do_sample=False, eos_token_id=eos, return_dict_in_generate=True, output_scores=True
    )
    reference = target.generate(prompt, **kwargs)
    drafter.reference = free_run
    output = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(output.sequences, reference.sequences)
    assert output.sequences[0, -1] == eos and output.sequences.shape[1] <= 6 + 13
    assert len(output.scores) == len(reference.scores)
    for ours, theirs in zip(output.scores, reference.scores):
        torch.testing.assert_close(ours, theirs.to(ours.dtype))


def test_stop_strings_and_streamer_behave_as_plain_generate(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    target = make_target("llama", vocab_size=len(tokenizer), seed=8, eos_token_id=None, pad_token_id=None)
    target.lm_head.weight.div_(8.0)
    drafter = OracleMTPDrafter.from_target(target, tokenizer, num_depths=3, draft_vocab_size=512)
    drafter.rng = random.Random(3)
    prompt = torch.tensor([tokenizer("The quick brown fox")["input_ids"]])
    free_run = target.generate(prompt, max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(free_run[0, prompt.shape[1] :])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    kwargs = dict(max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    reference = target.generate(prompt, **kwargs)
    drafter.reference = free_run
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    output = target.generate(prompt, assistant_model=drafter, streamer=streamer, **kwargs)
    assert torch.equal(output, reference)
    assert reference.shape[1] < free_run.shape[1], "the stop string must have ended generation early"
    assert "".join(streamer) == tokenizer.decode(output[0, prompt.shape[1] :])


@pytest.mark.parametrize(
    "settings, loop",
    [
        ({}, "engine"),
        ({"min_new_tokens": 0}, "engine"),
        ({"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9}, "engine"),
        ({"min_new_tokens": 3}, "transformers"),
        ({"repetition_penalty": 1.2}, "transformers"),
        ({"return_dict_in_generate": True}, "transformers"),
        ({"return_dict_in_generate": True, "output_scores": True}, "transformers"),
        ({"streamer": "streamer"}, "transformers"),
        ({"past_key_values": "prefilled"}, "engine"),
    ],
)
def test_one_sequence_decodes_on_the_engine_unless_the_call_asks_what_only_transformers_loop_gives(
    settings, loop, monkeypatch, smollm2_tokenizer
):
    """The engine's loop takes a single sequence whenever it reproduces the whole call; a streamer, another logits
    processor, scores or the returned cache take transformers' loop. Greedy output is plain decoding's on both, from
    a prefilled cache too (where transformers' assisted loop, prompt lookup's as well, decodes other tokens)."""
    from transformers import DynamicCache, TextStreamer

    from angelspec_hf.cache_utils import with_cache
    from angelspec_hf.generation import speculative

    target = make_target("llama", vocab_size=len(smollm2_tokenizer), seed=9)
    drafter = AngelSpecMTPDrafter.from_target(target, smollm2_tokenizer, num_depths=2)
    prompt = random_prompt(6, 90, 4)

    def call_settings():  # a streamer and a cache of the call's own
        made = {"do_sample": False, **settings}
        if settings.get("streamer"):
            made["streamer"] = TextStreamer(smollm2_tokenizer)
        if made.pop("past_key_values", None):  # by the keyword this transformers takes (`cache` from 5.25 on)
            made.update(with_cache(target(prompt[:, :4], **with_cache(DynamicCache())).past_key_values))
        return made

    loops = []
    on_engine = speculative.batched_speculative_decoding
    monkeypatch.setattr(
        speculative, "batched_speculative_decoding", lambda *a, **k: loops.append("engine") or on_engine(*a, **k)
    )
    monkeypatch.setattr(
        speculative,
        "AngelSpecCandidateGenerator",
        lambda *a, **k: loops.append("transformers") or AngelSpecCandidateGenerator(*a, **k),
    )
    output = target.generate(prompt, max_new_tokens=10, assistant_model=drafter, **call_settings())
    assert loops == [loop]
    if not settings.get("do_sample"):
        reference = target.generate(prompt, max_new_tokens=10, **call_settings())
        if settings.get("return_dict_in_generate"):
            output, reference = output.sequences, reference.sequences
        assert torch.equal(output, reference)


def test_a_batch_with_another_assistant_is_left_to_transformers():
    """Only AngelSpec drafters take the batched path (tests/test_engine.py); transformers' own assistants still get
    transformers' batch-size-1 rule."""
    target = make_target("llama")
    with pytest.raises(ValueError, match="batch_size = 1"):
        target.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=3, prompt_lookup_num_tokens=2)


@pytest.mark.parametrize("kind", ["mtp", "dfly", "suffix"])
def test_decoding_past_the_context_ends_as_plain_decoding_does(kind):
    """Plain `generate()` decodes past `max_position_embeddings` (with transformers' warning); so does speculative
    decoding, to the same tokens (it used to refuse)."""
    target = make_target("llama", num_hidden_layers=2, max_position_embeddings=32)
    drafter = {
        "mtp": lambda: AngelSpecMTPDrafter.from_target(target, num_depths=2),
        "dfly": lambda: DFlyDrafter.from_target(
            target, block_size=6, num_draft_layers=2, mask_token_id=5, num_target_layers_tapped=2
        ),
        "suffix": lambda: SuffixDrafter.from_target(target),
    }[kind]()
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
    assert plain.shape[1] > 32, "the plain output itself goes past the context"
    assert torch.equal(target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter), plain)
    batch = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])  # on the batched engine
    plain = target.generate(batch, max_new_tokens=40, do_sample=False)
    assert torch.equal(target.generate(batch, max_new_tokens=40, do_sample=False, assistant_model=drafter), plain)


def test_transformers_outside_the_supported_range_is_refused_in_one_line():
    """The routing wraps two private `GenerationMixin` methods: a transformers too old, or one whose methods lack what
    the wrappers read, is refused at import with the supported range named; setup.cfg declares the same range."""
    from angelspec_hf.generation.speculative import SUPPORTED_TRANSFORMERS, check_transformers

    check_transformers()  # the installed one
    check_transformers("5.30.0.dev0")  # newer releases are not refused on their number
    with pytest.raises(
        ImportError,
        match=r"transformers >=5.23 \(tested on 5.23.0 and .*\); this is transformers "
        r"5.22.2: too old",
    ):
        check_transformers("5.22.2")

    class Renamed:
        def _get_candidate_generator(self, generation_config, input_ids, assistant_model=None):
            pass

    with pytest.raises(
        ImportError, match="_get_candidate_generator lacks target_tokenizer; .*_assisted_decoding is gone"
    ):
        check_transformers(transformers.__version__, Renamed)
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg")) as handle:
        assert f"transformers{SUPPORTED_TRANSFORMERS}\n" in handle.read()


def test_other_assistants_are_delegated_to_transformers_unchanged():
    """Only AngelSpec drafters are rerouted."""
    target = make_target("llama")
    assistant = make_target("llama", seed=1)
    prompt = random_prompt(5, target.config.vocab_size, 0)
    seen = []
    original = angelspec_hf.generation.speculative._ORIGINAL_GET_CANDIDATE_GENERATOR

    def spy(self, *args, **kwargs):
        generator = original(self, *args, **kwargs)
        seen.append(type(generator))
        return generator

    angelspec_hf.generation.speculative._ORIGINAL_GET_CANDIDATE_GENERATOR = spy
    try:
        target.generate(prompt, max_new_tokens=5, do_sample=False, assistant_model=assistant)
        target.generate(prompt, max_new_tokens=5, do_sample=False, prompt_lookup_num_tokens=3)
        drafter = AngelSpecMTPDrafter.from_target(target)
        target.generate(prompt, max_new_tokens=5, do_sample=False, assistant_model=drafter)
    finally:
        angelspec_hf.generation.speculative._ORIGINAL_GET_CANDIDATE_GENERATOR = original
    assert seen == [AssistedCandidateGenerator, PromptLookupCandidateGenerator]
    assert GenerationMixin._get_candidate_generator.__wrapped__ is original


def test_empty_prompt_is_refused(smollm2_tokenizer):
    from angelspec_hf.prompts import encode_chat

    with pytest.raises(ValueError, match="Empty prompt"):
        encode_chat(smollm2_tokenizer, "   ")
    target = make_target("llama")
    drafter = AngelSpecMTPDrafter.from_target(target)
    with pytest.raises(ValueError, match="[Ee]mpty"):
        target.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3, assistant_model=drafter)


@pytest.mark.parametrize("loop", ["engine", "transformers"])
def test_a_round_profile_splits_each_round_into_the_target_forward_drafting_and_the_rest(loop, monkeypatch, request):
    """`speculation_stats.round_profile()` (and the engine's) gives the median milliseconds of a round in the target
    forward, in drafting and in the rest, on either loop of one sequence: time added to the target's forward lands in
    the first, time added to the verify policy's bookkeeping (after verification) in the last."""
    import time

    if loop == "transformers":
        request.getfixturevalue("on_transformers_loop")

    from angelspec_hf.generation.engine import Request, SpeculativeEngine

    target = make_target("llama", num_hidden_layers=2, seed=3)
    drafter = AngelSpecMTPDrafter.from_target(target, num_depths=2)
    drafter.generation_config.update(num_assistant_tokens=2, num_assistant_tokens_schedule="constant")
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    quick = drafter.speculation_stats.round_profile()
    # the stats' first entry is the prefill, not a round; the engine times every round after it, transformers' loop
    # all but the last, whose end it does not report
    assert quick["rounds"] == len(drafter.speculation_stats.drafted) - (2 if loop == "transformers" else 1)
    assert quick["draft_ms"] > 0 and quick["rest_ms"] < 15
    forward = target.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.02)
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", slow_forward)
    monkeypatch.setattr(policies.VerifyPolicy, "observe", lambda *args: time.sleep(0.03))
    target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    slow = drafter.speculation_stats.round_profile()
    engine = SpeculativeEngine(target, drafter, max_batch_size=2)
    engine.generate([Request([3, 1, 4], max_new_tokens=10), Request([9, 2], max_new_tokens=10)])
    batched = target.generate(
        torch.tensor([[3, 1, 4], [9, 2, 6]]), max_new_tokens=8, do_sample=False, assistant_model=drafter
    )
    assert slow["target_forward_ms"] >= 20 and slow["target_forward_ms"] - quick["target_forward_ms"] >= 12
    assert slow["rest_ms"] >= 30
    assert 0 < slow["draft_ms"] < 30  # neither sleep is counted as drafting
    served = engine.stats.round_profile()
    assert served["target_forward_ms"] >= 20 and served["rest_ms"] >= 30 and served["rounds"] == engine.stats.rounds
    assert batched.shape[0] == 2 and drafter.speculation_stats.round_profile()["rest_ms"] >= 30


def test_a_drafter_checks_a_target_once_and_every_other_one(monkeypatch):
    """Every generate() call binds its assistant again: the target it was checked against is not checked again (its
    config, embedding and tokenizer are the same objects), another target is, and refused if it is not the drafter's."""
    target = make_target("llama")
    drafter = AngelSpecMTPDrafter.from_target(target, num_depths=1)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"  # it drafts every round
    checked = []
    check = AngelSpecMTPDrafter.check_target
    monkeypatch.setattr(
        AngelSpecMTPDrafter,
        "check_target",
        lambda self, t, tokenizer=None: checked.append(t) or check(self, t, tokenizer),
    )
    for _ in range(2):
        target.generate(torch.tensor([[3, 5, 7]]), assistant_model=drafter, max_new_tokens=4, do_sample=False)
    assert checked == [] and sum(drafter.speculation_stats.drafted) > 0
    other = make_target("llama", vocab_size=128)
    with pytest.raises(ValueError, match="vocab_size"):
        drafter.bind_target(other)
    assert checked == [other]
