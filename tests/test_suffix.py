"""The suffix drafter: what its index matches, that it drafts where the output repeats, losslessly on every path,
and that it saves, loads and shares its index of earlier outputs. Its sampled law is tested in test_lossless.py."""

import pytest
import torch
from conftest import ARCHITECTURES, make_target
from transformers import AutoModel

import angelspec_hf
from angelspec_hf import SuffixDrafter
from angelspec_hf.generation import policies
from angelspec_hf.generation.dcut import FREE_ROUND_GAIN
from angelspec_hf.generation.engine import Request, SpeculativeEngine
from angelspec_hf.generation.policies import DrafterEstimates
from angelspec_hf.generation.session import memory_of
from angelspec_hf.generation.verify_cost import VerifyCostModel
from angelspec_hf.models.suffix.modeling_suffix import (
    SharedIndex,
    SuffixArrayIndex,
    SuffixIndex,
    draft_log_probabilities,
    join,
)


def repeating_prompt(target, seed=3):
    """A prompt ending where the target's own greedy text starts over: the continuation repeats the prompt."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, target.config.vocab_size - 1, (1, 6), generator=generator)
    text = target.generate(start, max_new_tokens=30, do_sample=False)
    return torch.cat([text, text[:, :10]], 1)


def found(match):
    """A match as (length, next-token counts)."""
    return match.length, match.counts


def test_the_index_finds_the_longest_earlier_match_and_what_followed_it():
    index = SuffixIndex(key_length=2, max_match_length=8, max_candidates=32)
    index.extend([1, 2, 3, 9, 4, 2, 3, 7, 1, 2, 3])
    # [1, 2, 3] occurred once before with 9 after it; [2, 3] twice more loosely (9 and 7)
    assert found(index.match([1, 2, 3])) == (3, {9: 1})
    assert found(index.match([5, 2, 3])) == (2, {9: 1, 7: 1})
    assert found(index.match([3, 8])) == (0, {})
    assert found(index.match([3])) == (0, {})  # shorter than the key: no match
    index.add_sequence([2, 3])  # a new sequence's last token has nothing after it, and no match crosses sequences
    assert found(index.match([6, 2, 3])) == (2, {9: 1, 7: 1})
    index.extend([5])
    assert found(index.match([2, 3])) == (2, {9: 1, 7: 1, 5: 1})
    capped = SuffixIndex(key_length=1, max_match_length=2, max_candidates=1)
    capped.extend([4, 5, 4, 6, 4])
    assert found(capped.match([4])) == (1, {6: 1})  # only the most recent earlier occurrence is compared


def test_draft_confidence_grows_with_match_length_and_agreement():
    def confidence(length, counts):
        return float(draft_log_probabilities(length, counts, 50).exp().max())

    assert confidence(2, {7: 1}) < confidence(6, {7: 1}) < confidence(30, {7: 1}) < 1.0
    assert confidence(6, {7: 1, 8: 1}) < confidence(6, {7: 2})
    q = draft_log_probabilities(3, {7: 3, 8: 1}, 50).exp()
    assert torch.isclose(q.sum(), torch.tensor(1.0)) and (q > 0).all()  # a full-support law: rejection sampling


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_greedy_output_is_the_targets_and_repeats_are_drafted(model_type):
    target = make_target(model_type, num_hidden_layers=4, seed=3)
    drafter = SuffixDrafter.from_target(target)
    for schedule in ("dcut", "constant", "heuristic"):
        drafter.generation_config.num_assistant_tokens_schedule = schedule
        for prompt in (torch.tensor([[7]]), torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), repeating_prompt(target)):
            expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
            output = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter)
            assert torch.equal(output, expected), (model_type, schedule)
        if schedule == "constant":  # the last prompt's continuation is in the prompt: most drafts are accepted
            assert drafter.speculation_stats.summary()["tau"] > 3.0


def test_custom_generate_and_the_engine_decode_as_generate(dcut_always_drafts):
    target = make_target("llama", num_hidden_layers=4, seed=5)
    drafter = SuffixDrafter.from_target(target, shared_index_max_tokens=0)
    prompts = [repeating_prompt(target, seed) for seed in (1, 2)] + [torch.tensor([[5, 6, 7]])]
    solo = [target.generate(p, max_new_tokens=20, do_sample=False) for p in prompts]
    for prompt, expected in zip(prompts, solo):
        output = target.generate(
            prompt,
            max_new_tokens=20,
            do_sample=False,
            custom_generate=angelspec_hf.speculative_generate,
            drafter=drafter,
        )
        assert torch.equal(output, expected)
    engine = SpeculativeEngine(target, drafter, max_batch_size=2)
    outputs = engine.generate([Request(p[0].tolist(), max_new_tokens=20, eos_token_id=[]) for p in prompts])
    assert [o.output_ids for o in outputs] == [e[0, p.shape[1] :].tolist() for e, p in zip(solo, prompts)]
    assert sum(sum(o.stats.accepted) for o in outputs[:2]) > 10


def test_a_match_drafts_a_round_under_dcut_whatever_the_average_saving_of_its_rounds(monkeypatch):
    """D-cut's average saving ĝ of the suffix drafter's rounds falls below zero where the cut drops most rounds'
    drafts; a round with a match still drafts (it costs only lookups, and the cut decides what is verified), so a
    repeat is drafted and accepted. A context without a match promises nothing."""
    target = make_target("llama", num_hidden_layers=4, seed=3)
    drafter = SuffixDrafter.from_target(target, shared_index_max_tokens=0)
    state = drafter.new_draft_state(1)
    assert drafter.promised_gain(state, [[1, 2, 3, 4, 5]]) == 0.0
    assert drafter.promised_gain(state, [[1, 2, 3, 4, 1, 2]]) == FREE_ROUND_GAIN
    prompt = repeating_prompt(target)
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    cost = VerifyCostModel(rows=[1], tokens=[1, 8], seconds=[[1.0, 1.2]], context=0)
    monkeypatch.setattr(policies, "load_cost_model", lambda target, rows=(1,): cost)
    memory_of(drafter).estimates = DrafterEstimates(read_ratio=0.0, drafting_gain={1: -0.5})  # rounds so far lost time
    output = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert torch.equal(output, expected)
    assert drafter.speculation_stats.summary()["tau"] > 2.0


def test_a_round_searches_each_rows_match_once_for_its_outlook_and_its_drafts(monkeypatch):
    """`promised_gain` (the outlook) and the round's `propose` read the same search of the text's end; drafting
    then follows the match token by token, and the next round's new tokens search afresh."""
    target = make_target("llama", num_hidden_layers=4, seed=3)
    drafter = SuffixDrafter.from_target(target, shared_index_max_tokens=0)
    searches, search = [], SuffixIndex.match
    monkeypatch.setattr(SuffixIndex, "match", lambda self, suffix: searches.append(1) or search(self, suffix))
    state = drafter.new_draft_state(1)
    assert drafter.promised_gain(state, [[1, 2, 3, 4, 1, 2]]) == FREE_ROUND_GAIN and len(searches) == 1
    no_tokens = torch.zeros(1, 0, dtype=torch.long)
    ids, _ = drafter.propose(state, (), no_tokens, 2, lambda logits: logits.argmax(-1))
    assert ids.tolist() == [[3, 4]] and len(searches) == 1
    drafter.propose(state, (), torch.tensor([[3, 4, 1]]), 1, lambda logits: logits.argmax(-1))
    assert len(searches) == 2


def test_finished_outputs_feed_the_shared_index_which_stays_bounded():
    target = make_target("llama", num_hidden_layers=4, seed=5)
    drafter = SuffixDrafter.from_target(target, shared_index_max_tokens=64)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    prompt = torch.tensor([[11, 12, 13, 14]])
    first = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    alone = drafter.speculation_stats.summary()["tau"]
    assert drafter.shared_index.tokens == first[0, 4:].tolist()  # the output, not the prompt
    again = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    assert torch.equal(again, first) and drafter.speculation_stats.summary()["tau"] > max(2 * alone, 3.0)
    engine = SpeculativeEngine(target, drafter, policy="constant-4", max_batch_size=2)
    engine.generate([Request([s, s + 1], max_new_tokens=25, eos_token_id=[]) for s in range(20, 30)])
    assert len(drafter.shared_index) <= 64 and drafter.shared_index.tokens[-1] != -1


def test_save_and_load_keep_the_shared_index_and_generation_config(tmp_path):
    target = make_target("qwen2", num_hidden_layers=4)
    empty = SuffixDrafter.from_target(target)
    empty.save_pretrained(tmp_path / "empty")
    assert len(AutoModel.from_pretrained(tmp_path / "empty").shared_index) == 0
    drafter = SuffixDrafter.from_target(target, min_match_length=3, shared_index_max_tokens=1000)
    for seed in range(3):
        drafter.record_output(torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(seed)).tolist())
    drafter.generation_config.update(num_assistant_tokens=5, num_assistant_tokens_schedule="heuristic")
    drafter.save_pretrained(tmp_path / "full")
    loaded = AutoModel.from_pretrained(tmp_path / "full")
    assert type(loaded) is SuffixDrafter and loaded.config.min_match_length == 3
    assert loaded.shared_index.tokens == drafter.shared_index.tokens and len(loaded.shared_index) == 3 * 41 - 1
    assert loaded.generation_config.num_assistant_tokens == 5
    assert loaded.generation_config.num_assistant_tokens_schedule == "heuristic"
    loaded.record_output(list(range(10)))  # a loaded index keeps growing
    assert loaded.shared_index.tokens[-11:] == [-1] + list(range(10))


def test_forgetting_served_requests_returns_to_the_index_as_saved_without_rebuilding_its_suffix_array(tmp_path):
    target = make_target("llama", num_hidden_layers=2)
    drafter = SuffixDrafter.from_target(target, shared_index_max_tokens=4000)
    saved = [torch.randint(0, 90, (300,), generator=torch.Generator().manual_seed(seed)).tolist() for seed in range(5)]
    drafter.index_outputs(saved)
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    array = loaded.shared_index.array
    assert len(array) == 5 * 301 - 1, "the saved outputs are in the suffix array"
    loaded.record_output(list(range(40)))
    assert loaded.shared_index.tokens[-41:] == [-1] + list(range(40))
    loaded.forget_served_requests()
    assert loaded.shared_index.array is array and loaded.shared_index.tokens == join(saved)
    loaded.record_output(list(range(50, 90)))  # the copy grows apart from the index as saved
    loaded.forget_served_requests()
    assert loaded.shared_index.tokens == join(saved)
    loaded.index_outputs([list(range(10, 30))])
    loaded.prepare_for_saving()  # a new buffer: the index as saved is built again, from it
    loaded.forget_served_requests()
    assert loaded.shared_index.array is not array and loaded.shared_index.tokens == join(saved + [list(range(10, 30))])
    loaded.shared_tokens.fill_(-1)  # a buffer changed in place is read again
    loaded.forget_served_requests()
    assert len(loaded.shared_index) == 0


def test_any_target_of_its_vocabulary_serves_and_there_are_no_weights_to_train():
    """(Refusals of another vocabulary or tokenizer are the common drafter tests', test_drafters_common.py.)"""
    drafter = SuffixDrafter.from_target(make_target("llama", num_hidden_layers=2))
    drafter.bind_target(make_target("qwen3", num_hidden_layers=2, seed=4))
    with pytest.raises(NotImplementedError, match="no weights to train"):
        drafter(None)


def brute_force_match(text, suffix, key_length, max_match_length):
    """The longest match of `suffix`'s end in `text` (sequences apart) followed by a token, and what followed every
    occurrence that long: the definition the indexes implement."""
    best, counts = 0, {}
    for end in range(len(text) - 1):
        if text[end + 1] == -1:
            continue
        length = 0
        while (
            length < min(len(suffix), max_match_length)
            and end - length >= 0
            and text[end - length] == suffix[-1 - length]
        ):
            length += 1
        if length < max(best, key_length):
            continue
        if length > best:
            best, counts = length, {}
        counts[text[end + 1]] = counts.get(text[end + 1], 0) + 1
    return best, counts


@pytest.mark.parametrize("seed", range(6))
def test_the_suffix_array_finds_the_longest_match_and_counts_every_occurrence(seed):
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, 4, (int(n),), generator=generator).tolist() for n in torch.randint(1, 40, (8,))]
    text = join(sequences)
    index = SuffixArrayIndex(text, key_length=1 + seed % 2, max_match_length=6)
    assert index.tokens == text
    for _ in range(40):
        suffix = torch.randint(0, 5, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator)
        expected = brute_force_match(text, suffix.tolist(), 1 + seed % 2, 6)
        assert found(index.match(suffix.tolist())) == expected
    assert found(SuffixArrayIndex([], 1, 6).match([1, 2])) == (0, {})


@pytest.mark.parametrize("seed", range(4))
def test_following_a_drafted_token_narrows_the_match_as_a_new_search_would(seed):
    """A draft step extends the suffix by the drafted token: `Match.follow` keeps the occurrences it continues, which
    below the longest compared length is exactly what searching the extended suffix finds (in the suffix array, in
    the shared index's two parts, and in an n-gram index comparing every occurrence); None when none continues."""
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, 4, (int(n),), generator=generator).tolist() for n in torch.randint(1, 40, (8,))]
    shared = SharedIndex(key_length=1, max_match_length=12, max_candidates=1000, max_tokens=1000)
    shared.add_sequences(sequences[:5])
    shared._build(3)  # three sequences in the array, two in the n-gram part
    indexes = [SuffixArrayIndex(join(sequences), 1, 12), shared, SuffixIndex(1, 12, 1000)]
    indexes[2].extend(join(sequences))
    for _ in range(30):
        suffix = torch.randint(0, 4, (int(torch.randint(1, 5, (1,), generator=generator)),), generator=generator)
        for index in indexes:
            match = index.match(suffix.tolist())
            for token in range(4):
                followed = match.follow(token) if match.length else None
                again = index.match(suffix.tolist() + [token])
                if followed is None:
                    assert again.length <= match.length
                else:
                    assert found(followed) == found(again), (index, suffix.tolist(), token)


def test_the_shared_index_folds_recorded_outputs_into_its_array_and_stays_bounded(monkeypatch):
    monkeypatch.setattr("angelspec_hf.models.suffix.modeling_suffix.FOLD_TOKENS", 200)
    index = SharedIndex(key_length=1, max_match_length=8, max_candidates=1000, max_tokens=200)
    generator = torch.Generator().manual_seed(0)
    added, both = [], False
    for _ in range(20):
        sequence = torch.randint(0, 5, (15,), generator=generator).tolist()
        index.add_sequences([sequence])
        added.append(sequence)
        assert index.tokens == join(list(index.sequences)) and len(index) == len(index.tokens) <= 200
        assert list(index.sequences) == added[-len(index.sequences) :]  # the newest kept, the oldest left first
        for _ in range(10):
            suffix = torch.randint(0, 5, (5,), generator=generator).tolist()
            assert found(index.match(suffix)) == brute_force_match(index.tokens, suffix, 1, 8)
        both = both or bool(len(index.array) and len(index.recent))  # some folded in, the newest not yet
    assert both and len(index.sequences) < 20
    index.add_sequences([[7]])  # too short to follow anything: not kept
    assert index.tokens[-1] != 7


def test_the_index_outputs_command_seeds_the_shared_index_of_a_suffix_drafter_or_router(tmp_path, capsys):
    import gzip
    import json

    from angelspec_hf import AngelSpecMTPDrafter, RouterDrafter
    from angelspec_hf.cli import main

    target = make_target("llama", num_hidden_layers=2)
    responses = [[5, 6, 7, 8, 9], [5, 6, 7, 3], [40, 41]]
    with gzip.open(tmp_path / "responses.jsonl.gz", "wt") as handle:
        for ids in responses:
            handle.write(json.dumps({"source": "s", "prompt": "p", "prompt_ids": [1], "response_ids": ids}) + "\n")
    suffix = SuffixDrafter.from_target(target, shared_index_max_tokens=100)
    suffix.save_pretrained(tmp_path / "suffix")
    mtp = AngelSpecMTPDrafter.from_target(target, num_depths=2)
    RouterDrafter.from_members([mtp, SuffixDrafter.from_target(target)]).save_pretrained(tmp_path / "router")
    mtp.save_pretrained(tmp_path / "mtp")
    main(["index-outputs", "--drafter", str(tmp_path / "suffix"), "--responses", str(tmp_path / "responses.jsonl.gz"),
          "--output", str(tmp_path / "seeded"), "--max-tokens", "50"])  # fmt: skip
    seeded = AutoModel.from_pretrained(tmp_path / "seeded")
    assert seeded.shared_index.tokens == join(responses) and seeded.config.shared_index_max_tokens == 50
    assert found(seeded.shared_index.match([1, 5, 6, 7])) == (3, {8: 1, 3: 1})  # both responses, counted
    main(["index-outputs", "--drafter", str(tmp_path / "router"), "--responses", str(tmp_path / "responses.jsonl.gz"),
          "--output", str(tmp_path / "router-seeded")])  # fmt: skip
    router = AutoModel.from_pretrained(tmp_path / "router-seeded")
    assert router.members[1].shared_index.tokens == join(responses)
    (tmp_path / "evaluation.jsonl").write_text(json.dumps({"prompt": " P "}) + "\n")  # the responses' prompt "p"
    main(["index-outputs", "--drafter", str(tmp_path / "suffix"), "--responses", str(tmp_path / "responses.jsonl.gz"),
          "--output", str(tmp_path / "clean"), "--exclude", str(tmp_path / "evaluation.jsonl")])  # fmt: skip
    assert len(AutoModel.from_pretrained(tmp_path / "clean").shared_index) == 0
    for argv, problem in (
        (["--drafter", tmp_path / "mtp", "--responses", tmp_path / "responses.jsonl.gz"], "neither a suffix drafter"),
        (["--drafter", tmp_path / "suffix", "--responses", tmp_path / "missing.jsonl.gz"], "no such file"),
        (["--drafter", tmp_path / "suffix", "--responses", tmp_path / "evaluation.jsonl"], "no responses in it"),
        (
            ["--drafter", tmp_path / "suffix", "--responses", tmp_path / "responses.jsonl.gz", "--exclude", "nope"],
            "nope",
        ),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["index-outputs", *map(str, argv), "--output", str(tmp_path / "out")])
        assert exit_info.value.code == 2 and problem in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def drafting_match(drafter, state, suffix):
    return drafter.drafting_match(state.rows[0].match(suffix), drafter.shared_match(suffix))


def test_a_row_drafts_from_its_own_text_unless_the_shared_index_matches_longer_by_more_than_the_margin():
    target = make_target("llama", num_hidden_layers=2)
    drafter = SuffixDrafter.from_target(target, shared_match_margin=1)
    drafter.shared_index.add_sequences([[7, 8, 9, 10, 11, 50], [1, 2, 3, 60]])
    state = drafter.new_draft_state(1)
    state.rows[0].extend([10, 11, 40, 2, 3, 41])  # its own text: [10, 11] then 40, [2, 3] then 41
    # shared: 3 long, not more than 1 longer
    assert found(drafting_match(drafter, state, [5, 1, 2, 3])) == (2, {41: 1})
    assert found(drafting_match(drafter, state, [8, 9, 10, 11])) == (4, {50: 1})  # shared: 4 long against 2
    drafter.config.shared_index_max_tokens = 0  # no shared index at all
    assert found(drafting_match(drafter, state, [8, 9, 10, 11])) == (2, {40: 1})
    with pytest.raises(ValueError, match="shared_match_margin"):
        SuffixDrafter.from_target(target, shared_match_margin=-1)


def test_ids_outside_the_vocabulary_are_refused_where_an_index_is_built_and_loaded(tmp_path, capsys):
    import gzip
    import json

    from safetensors.torch import load_file, save_file

    from angelspec_hf.cli import main

    target = make_target("llama", num_hidden_layers=2)  # vocabulary 96
    drafter = SuffixDrafter.from_target(target, shared_index_max_tokens=100)
    with pytest.raises(ValueError, match="output 2: token id 1000000 is outside the target's vocabulary"):
        drafter.index_outputs([[5, 6], [7, 1000000]])
    with pytest.raises(ValueError, match="token id -3"):
        drafter.index_outputs([[-3]])
    assert len(drafter.shared_index) == 0, "nothing indexed from a refused corpus"
    drafter.save_pretrained(tmp_path / "suffix")
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as handle:
        for ids in ([5, 6, 7], [8, 1000000]):
            handle.write(json.dumps({"source": "s", "prompt": "p", "prompt_ids": [1], "response_ids": ids}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["index-outputs", "--drafter", str(tmp_path / "suffix"), "--responses", str(bad), "--output",
              str(tmp_path / "out")])  # fmt: skip
    assert exit_info.value.code == 2
    assert f"{bad}, output 2: token id 1000000 is outside" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # A saved index edited to hold an id the target cannot read is refused on load, naming the folder.
    drafter.index_outputs([[5, 6, 7]])
    drafter.save_pretrained(tmp_path / "edited")
    weights = load_file(tmp_path / "edited" / "model.safetensors")
    weights["shared_tokens"][1] = 500
    save_file(weights, tmp_path / "edited" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="edited: the shared index .*token id 500"):
        SuffixDrafter.from_pretrained(tmp_path / "edited")


def test_a_drafter_failing_while_drafting_costs_the_rows_running_their_drafts_not_their_outputs(
    monkeypatch, package_log
):
    """The drafter raises on any round whose text holds token 77 (one request's prompt): the four requests running
    decode on without drafts and end as plain decoding; the requests admitted after they left draft again."""
    target = make_target("llama", num_hidden_layers=2)
    drafter = SuffixDrafter.from_target(target, shared_index_max_tokens=0)
    propose = SuffixDrafter.propose

    def fragile(self, state, hidden, tokens, *args, **kwargs):
        if (tokens == 77).any():
            raise IndexError("index 1000000 is out of bounds")
        return propose(self, state, hidden, tokens, *args, **kwargs)

    monkeypatch.setattr(SuffixDrafter, "propose", fragile)
    pattern = [7, 8, 9, 10, 11, 12]
    prompts = [pattern * 3 + [20 + i] for i in range(8)]
    prompts[1] = prompts[1][:-1] + [77]
    requests = [Request(prompt, max_new_tokens=24, request_id=i) for i, prompt in enumerate(prompts)]
    references = {
        r.request_id: target.generate(torch.tensor([r.input_ids]), max_new_tokens=24, do_sample=False)[
            0, len(r.input_ids) :
        ].tolist()
        for r in requests
    }
    engine = SpeculativeEngine(target, drafter, policy="constant-4", max_batch_size=4)
    with package_log.warns("drafter failed while drafting .*IndexError.*4 requests running"):
        outputs = engine.generate(requests)
    assert [o.output_ids for o in outputs] == [references[r.request_id] for r in requests]
    assert all(o.finish_reason in ("eos", "length") for o in outputs)
    assert sum(sum(o.stats.accepted) for o in outputs[:4]) == 0, "the rows running at the failure drafted no more"
    assert sum(sum(o.stats.accepted) for o in outputs[4:]) > 0, "later requests draft again"
