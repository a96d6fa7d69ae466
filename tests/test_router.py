"""The router drafter: lossless on every path with members chosen per request (the members' states split and
merged back), routing by what each member's drafts earned on each request, one folder that saves and loads. Its
sampled law is tested in test_lossless.py."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import make_target, rotate_router_members
from transformers import AutoModel

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter, RouterDrafter, SuffixDrafter
from angelspec_hf.generation.dcut import FREE_ROUND_GAIN
from angelspec_hf.generation.draft_round import DraftRound
from angelspec_hf.generation.engine import Request, SpeculativeEngine
from angelspec_hf.generation.routing import DELIVERY_PRIOR_ROUNDS, TRY_SHARE, RoutingPolicy
from angelspec_hf.generation.session import DecodingSession, routing_of
from angelspec_hf.generation.verify_cost import VerifyCostModel


def make_router(target, **suffix_options):
    torch.manual_seed(0)
    members = [
        AngelSpecMTPDrafter.from_target(target, num_depths=3),
        DFlyDrafter.from_target(target, block_size=6, num_draft_layers=2, mask_token_id=5, num_target_layers_tapped=2),
        SuffixDrafter.from_target(target, **suffix_options),
    ]
    return RouterDrafter.from_members(members)


def priced_router(rows=(1,), **suffix_options):
    """A router over a 2-layer target and its routing policy, priced by a profile where a verify forward costs 1 s for one token per row
    and 1.3 s for four, at every batch size in `rows`."""
    target = make_target("llama", num_hidden_layers=2)
    router = make_router(target, **suffix_options)
    routing = routing_of(router)
    routing.cost_model = VerifyCostModel(rows=list(rows), tokens=[1, 4], seconds=[[1.0, 1.3]] * len(rows), context=0)
    return target, router, routing


def repeating_prompt(target, seed=3):
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, target.config.vocab_size - 1, (1, 6), generator=generator)
    text = target.generate(start, max_new_tokens=30, do_sample=False)
    return torch.cat([text, text[:, :10]], 1)


def test_every_member_is_tried_under_every_schedule_and_the_output_stays_the_targets():
    """(Greedy equality on every architecture, batches, saving and loading, remote code and refusals are the common
    drafter tests', test_drafters_common.py.)"""
    target = make_target("llama", num_hidden_layers=4, seed=3)
    router = make_router(target)
    routing = routing_of(router)
    assert router.target_hidden_state_indices() == sorted(
        {i for member in router.members for i in member.target_hidden_state_indices()}
    )
    for schedule in ("constant", "heuristic", "dcut"):
        router.generation_config.num_assistant_tokens_schedule = schedule
        for prompt in (torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), repeating_prompt(target)):
            expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
            output = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=router)
            assert torch.equal(output, expected), schedule
    assert None not in routing.member_accepted  # every member was tried


@pytest.mark.parametrize("policy", ["constant-4", "heuristic", "dcut"])
def test_requests_drafted_by_different_members_decode_as_each_alone(policy, monkeypatch, dcut_always_drafts):
    target = make_target("llama", num_hidden_layers=4, seed=5)
    router = make_router(target, shared_index_max_tokens=0)
    prompts = [repeating_prompt(target, 1)[0].tolist(), [5, 6, 7], [9], repeating_prompt(target, 2)[0].tolist(), [44]]
    solo = [
        target.generate(torch.tensor([p]), max_new_tokens=18, do_sample=False)[0, len(p) :].tolist() for p in prompts
    ]
    rounds = rotate_router_members(monkeypatch)
    engine = SpeculativeEngine(target, router, policy=policy, max_batch_size=3)
    outputs = engine.generate([Request(p, max_new_tokens=18, eos_token_id=[]) for p in prompts])
    assert [o.output_ids for o in outputs] == solo and rounds["count"] > 5
    assert sum(sum(o.stats.accepted) for o in outputs) > 0


def test_each_request_is_drafted_by_the_member_that_earns_most_on_it():
    """Under a profile where verifying costs little, a request whose output repeats its prompt ends up with the
    suffix member; one whose output is new, with a member that drafts it right (an MTP head told the answer)."""
    target = make_target("llama", num_hidden_layers=4, seed=5)
    router = make_router(target, shared_index_max_tokens=0)
    routing = routing_of(router)
    routing.cost_model = VerifyCostModel(rows=[1], tokens=[1, 16], seconds=[[1.0, 1.2]], context=0)
    router.config.explore_tokens = 1000
    router.config.free_match_first = 0  # the scores alone decide (the rule before them: its own test)
    repeating = repeating_prompt(target, 1)
    counts = {}
    original = SuffixDrafter.propose

    def counting(self, state, *args, **kwargs):
        counts["suffix"] = counts.get("suffix", 0) + 1
        return original(self, state, *args, **kwargs)

    SuffixDrafter.propose = counting
    try:
        router.generation_config.num_assistant_tokens_schedule = "constant"
        target.generate(repeating, max_new_tokens=40, do_sample=False, assistant_model=router)
    finally:
        SuffixDrafter.propose = original
    rounds = len(router.speculation_stats.drafted)
    assert counts["suffix"] >= rounds - 4  # after one try of each member, the suffix member drafts on
    assert routing.member_accepted[2] > max(routing.member_accepted[:2])


def test_promised_gain_is_optimistic_for_a_try_and_prices_the_best_member_otherwise():
    # two requests verify together as one did (the per-request figures below); see the end for a costlier batch
    target, router, routing = priced_router(rows=(1, 2))
    router.config.free_match_first = 0  # the scores alone decide (the rule before them: its own test)
    state = router.new_draft_state(2)
    assert routing.plan(state) > 0  # fresh requests: their members are due a try
    routing.member_seconds = [0.05, 0.1, 0.01]
    for row in state.rows:  # both requests have tried MTP and DFly; the suffix member judges by its outlook
        for own, accepted in zip(row.members[:2], (0.1, 0.2)):
            own.accepted, own.verified = accepted, {2: 1.0}
    routing.bucket_record[2][0] = (0.0, {0: 1.0})  # no match: nothing accepted
    # DFly: (1 + 0.2) / (0.1 + t_v(3) = 1.2) tokens per second, MTP less; the suffix member without a match drafts
    # nothing for its 0.01 s, 1 / 1.01: the best, and still below the 1 token per second of not drafting
    assert routing.score(state.rows[0], 1) == pytest.approx(1.2 / 1.3)
    assert routing.score(state.rows[0], 0) < routing.score(state.rows[0], 1)
    assert routing.choice(state, 0)[:2] == (2, 0)
    assert routing.plan(state) == pytest.approx(1 - 1.01)
    for index in state.members[2].rows:  # now each request's text repeats: the suffix member sees a match
        index.extend([1, 2, 3, 4, 5, 1, 2, 3])
    routing.bucket_record[2][int(3).bit_length()] = (3.0, {3: 1.0})
    assert routing.choice(state, 0)[:2] == (2, 2)
    assert routing.plan(state) == pytest.approx(1 - 1 / (4.0 / (0.01 + 1.3)))
    for row in state.rows:  # a member not tried for explore_tokens tokens is due again (and waited its longest
        row.members[0].since = router.config.explore_tokens  # for a round the suffix member would not draft)
        row.members[0].due_since = row.read - router.config.explore_tokens
    assert routing.choice(state, 0) == (0, None, True) and routing.plan(state) > 0
    # where widening the batch's verify costs more (compute-bound), the same record promises less
    for row in state.rows:
        row.members[0].since = 0
    cheap = routing.plan(state)
    routing.cost_model = VerifyCostModel(rows=[1, 2], tokens=[1, 4], seconds=[[1.0, 1.3], [1.0, 2.5]], context=0)
    assert routing.plan(state) < cheap


def test_a_due_try_waits_for_a_round_no_other_member_would_draft_at_most_explore_tokens():
    """A try displaces the round's member: while the suffix member has a match its record says pays, MTP's due
    re-try waits (the suffix member drafts), for at most `explore_tokens` verified tokens; in a round without a
    match, where nothing would be drafted, it goes at once."""
    target, router, routing = priced_router()
    router.config.free_match_first = 0  # a match of 3 would otherwise take every round (the next test)
    routing.member_seconds = [0.05, 0.1, 0.01]
    state = router.new_draft_state(1)
    row = state.rows[0]
    routing.admit(state, 0)
    for m, own in enumerate(row.members[:2]):  # both tried before, accepting little; MTP's re-try is due
        own.accepted, own.verified = routing.member_accepted[m], routing.member_verified[m] = 0.1, {2: 1.0}
    row.members[0].since = router.config.explore_tokens
    state.members[2].rows[0].extend([1, 2, 3, 4, 5, 1, 2, 3])  # the suffix member has a match of 3
    routing.bucket_record[2][int(3).bit_length()] = (3.0, {3: 1.0})
    routing.bucket_record[2][0] = (0.0, {0: 1.0})  # and without a match accepts nothing
    row.read = 100
    assert routing.choice(state, 0) == (2, 2, False) and row.members[0].due_since == 100
    row.read += router.config.explore_tokens - 1
    assert routing.choice(state, 0) == (2, 2, False)
    row.read += 1
    assert routing.choice(state, 0) == (0, None, True)
    row.members[0].due_since = None
    state.members[2].rows[0].extend([7])  # no match now: the round would draft nothing, so the try goes at once
    assert routing.choice(state, 0) == (0, None, True)


def test_a_suffix_member_with_a_match_of_free_match_first_tokens_drafts_before_the_scores_and_tries():
    """A match of at least `free_match_first` tokens gives the suffix member the round, though MTP's score is
    higher and its re-try is due; a shorter match leaves the round to the scores, as does `free_match_first=0`."""
    target, router, routing = priced_router(shared_index_max_tokens=0)
    assert router.config.free_match_first == 2
    routing.member_seconds = [0.05, 0.1, 0.01]
    state = router.new_draft_state(1)
    row = state.rows[0]
    routing.admit(state, 0)
    for m, accepted in ((0, 3.0), (1, 0.1)):  # MTP accepts 3 drafts a round on this request, DFly little
        row.members[m].accepted, row.members[m].verified = accepted, {3: 1.0}
    for bucket in range(4):  # the suffix member's records: nothing accepted at any match length
        routing.bucket_record[2][bucket] = (0.0, {3: 1.0})
    state.members[2].rows[0].extend([1, 2, 3, 4, 5, 1, 2, 3])  # a match of 3
    assert routing.score(row, 0) > max(routing.score(row, 2, 2), 1.0)
    assert routing.choice(state, 0) == (2, 2, False)
    row.members[0].since = router.config.explore_tokens  # MTP's re-try is due: the match still takes the round
    assert routing.choice(state, 0) == (2, 2, False)
    row.members[0].since = 0
    state.members[2].rows[0].extend([5])  # "3 5" never came before, "5" did: a match of 1, the scores decide
    assert router.outlooks(state, 0)[2] == 1 and routing.choice(state, 0) == (0, None, False)
    state.members[2].rows[0].extend([1, 2])  # "5 1 2" came before: a match of 3 again
    router.config.free_match_first = 4
    assert routing.choice(state, 0) == (0, None, False)
    router.config.free_match_first = 0
    assert routing.choice(state, 0) == (0, None, False)
    with pytest.raises(ValueError, match="free_match_first must be 0 or a power of two"):
        type(router.config)(members=router.config.members, free_match_first=3)


def test_a_member_that_loses_its_tries_sits_out_the_tries_of_the_next_requests():
    """A try reads a request's whole backlog; a member whose tries lose (MTP accepting nothing) is tried on ever
    fewer new requests (1, 2, 4, ... skipped), and one win clears its backoff."""
    target, router, routing = priced_router()
    routing.member_seconds = [0.05, 0.1, 0.01]
    routing.bucket_record[2][0] = (0.0, {0: 1.0})  # the suffix member without a match accepts nothing

    def first_request_trying_mtp(result: int) -> int:
        """Admit new requests until one tries MTP; that try accepts `result` of 3 drafts. Returns requests skipped."""
        skipped = 0
        while True:
            state = router.new_draft_state(1)
            m, _, trying = routing.choice(state, 0)
            if trying and m == 0:
                break
            assert not state.rows[0].members[0].tries
            skipped += 1
        state.rows[0].last_member, state.rows[0].last_try = 0, True
        routing.record_acceptance(state, [3], [result])
        return skipped

    assert [first_request_trying_mtp(0) for _ in range(4)] == [0, 1, 2, 4]
    assert routing.try_wait[0] == 8
    routing.try_wait[0] = 0
    assert first_request_trying_mtp(3) == 0 and routing.try_backoff[0] == routing.try_wait[0] == 0  # a win
    assert first_request_trying_mtp(0) == 0 and routing.try_wait[0] == 1


def test_save_and_load_keep_every_member_with_its_own_state(tmp_path):
    target = make_target("llama", num_hidden_layers=4)
    router = make_router(target)
    router.members[2].record_output([1, 2, 3, 4, 5])
    router.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert type(loaded) is RouterDrafter and loaded.member_names == ["mtp", "dfly", "suffix"]
    assert [type(m) for m in loaded.members] == [AngelSpecMTPDrafter, DFlyDrafter, SuffixDrafter]
    assert sorted(os.listdir(tmp_path / "members")) == ["dfly", "mtp", "suffix"]  # each loads alone too
    assert loaded.members[2].shared_index.tokens == [1, 2, 3, 4, 5]


def test_a_router_names_members_saved_on_their_own_instead_of_holding_their_weights_again(tmp_path):
    """`member_paths` names members already saved elsewhere (a folder relative to the router's): only the others are
    written under members/. Saved again without it, the router holds every member; a named member that is gone is
    an error naming it, and a reference to no drafter is refused before anything is written."""
    target = make_target("llama", num_hidden_layers=4)
    router = make_router(target)
    for name, member in zip(router.member_names, router.members):
        member.save_pretrained(tmp_path / name)
    router.save_pretrained(tmp_path / "router", member_paths={"mtp": "../mtp", "dfly": "../dfly"})
    assert os.listdir(tmp_path / "router" / "members") == ["suffix"]
    assert json.loads((tmp_path / "router" / "config.json").read_text())["member_paths"] == [
        "../mtp",
        "../dfly",
        "members/suffix",
    ]
    loaded = AutoModel.from_pretrained(tmp_path / "router")
    for (name, ours), (_, theirs) in zip(router.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(ours.float(), theirs.float(), msg=name)
    prompt = torch.tensor([[3, 5, 7, 9]])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=loaded), expected)
    loaded.save_pretrained(tmp_path / "whole" / "router")
    assert sorted(os.listdir(tmp_path / "whole" / "router" / "members")) == ["dfly", "mtp", "suffix"]
    shutil.rmtree(tmp_path / "mtp")
    with pytest.raises(FileNotFoundError, match="member 'mtp'"):
        AutoModel.from_pretrained(tmp_path / "router")
    assert type(AutoModel.from_pretrained(tmp_path / "whole" / "router")) is RouterDrafter
    with pytest.raises(ValueError, match="no drafter folder there"):
        router.save_pretrained(tmp_path / "bad", member_paths={"mtp": "../nowhere"})
    with pytest.raises(ValueError, match="not members of this router"):
        router.save_pretrained(tmp_path / "bad", member_paths={"eagle": "../dfly"})
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("name", ["../../outside_member", "/tmp/absolute_member", "a/b", "..", "", "sub\\dir"])
def test_member_names_are_plain_folder_names_on_load_and_on_save(name, tmp_path):
    """A member name is a folder under members/: one that would leave the router's folder is refused when a config
    names it (loading) and before a save writes anything."""
    target = make_target("llama", num_hidden_layers=2)
    members = [SuffixDrafter.from_target(target, shared_index_max_tokens=0)]
    with pytest.raises(ValueError, match="not a plain folder name under members/"):
        RouterDrafter.from_members(members, names=[name])
    router = RouterDrafter.from_members(members, names=["suffix"])
    router.save_pretrained(tmp_path / "router")
    config_path = tmp_path / "router" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "member_names": [name]}))
    with pytest.raises(ValueError, match="not a plain folder name under members/"):
        AutoModel.from_pretrained(tmp_path / "router")
    router.member_names = [name]  # as a loaded router re-saved after its names were changed
    with pytest.raises(ValueError, match="not a plain folder name under members/"):
        router.save_pretrained(tmp_path / "inside" / "saved")
    assert os.listdir(tmp_path / "inside") == [], "nothing written, inside the save's folder or beside it"


def test_members_of_another_target_or_vocabulary_are_refused():
    target = make_target("llama", num_hidden_layers=2)
    other = make_target("llama", num_hidden_layers=2, vocab_size=64)
    with pytest.raises(ValueError, match="different vocabularies"):
        RouterDrafter.from_members([SuffixDrafter.from_target(target), SuffixDrafter.from_target(other)])
    router = make_router(target)
    with pytest.raises(ValueError, match="Router member 'mtp'.*hidden_size"):
        router.bind_target(make_target("llama", num_hidden_layers=2, hidden_size=32, head_dim=8))


def test_switching_to_a_member_pays_for_its_catch_up_and_the_policy_adds_none():
    """A member that must first read tokens left by rounds it did not draft is charged its measured time per token
    read beyond a usual round; the suffix member reads for free. D-cut leaves that pricing to the routing policy."""
    from angelspec_hf.generation.policies import DCut

    target, router, routing = priced_router()
    routing.member_seconds, routing.member_read_seconds = [0.05, 0.1, 0.01], [0.002, 0.004, 0.5]
    state = router.new_draft_state(1)
    row = state.rows[0]
    for own in row.members:
        own.accepted, own.verified = 1.0, {2: 1.0}
    caught_up = routing.score(row, 0)
    row.members[0].tokens = list(range(104))  # 100 beyond MTP's usual round of 1 + 3
    assert routing.score(row, 0) == pytest.approx(2.0 / (0.05 + 100 * 0.002 + 1.2))
    assert routing.score(row, 0, pending=10) == pytest.approx(2.0 / (0.05 + 110 * 0.002 + 1.2))
    assert routing.score(row, 0) < caught_up
    row.members[2].tokens = list(range(500))
    assert routing.catch_up_seconds_of(2, 500) == 0.0  # reading is free for the suffix member
    routed = DecodingSession(target, router, DCut(max_draft=4, cost_model=routing.cost_model))
    assert routed.routing is routing and routed.policy.catch_up_seconds(backlog=500) == 0.0
    solo = DecodingSession(target, router.members[0], DCut(max_draft=4, cost_model=routing.cost_model))
    assert solo.routing is None and solo.policy.catch_up_seconds(backlog=500) > 0.0


def test_a_catch_up_is_spread_over_the_rounds_the_request_has_left():
    """Reading is linear in the tokens read, so a member that drafts again in a request pays for every token it
    skipped, whenever it switches: the catch-up is spread over the rounds left (the request's own tokens left over
    1 + a). Charged to the switching round alone it grew with every round another member drafted and kept MTP out of
    the request; spread over the batch's tokens left, a request near its end beside a long one would spread it over
    rounds it does not have."""
    target, router, routing = priced_router(shared_index_max_tokens=0)
    routing.member_seconds, routing.member_read_seconds = [0.05, 0.1, 0.01], [0.002, 0.004, 0.5]
    state = router.new_draft_state(2)
    for r, row in enumerate(state.rows):
        routing.admit(state, r)
        for own in row.members:
            own.tries = False  # no tries: the records decide
        row.members[0].accepted, row.members[0].verified = 1.0, {2: 1.0}
        row.members[1].accepted, row.members[1].verified = 0.0, {1: 1.0}
        row.members[0].tokens = list(range(1004))  # MTP skipped 1,000 tokens beyond its usual round of 1 + 3
    routing.bucket_record[2][0] = (0.2, {1: 1.0})  # the suffix member without a match: 1.2 tokens a round
    long, ending = state.rows
    assert routing.score(long, 0) == pytest.approx(2.0 / (0.05 + 1000 * 0.002 + 1.2))  # unknown: one round
    routing.plan(state, tokens_left=[400, 2])  # 200 rounds of 1 + a = 2 tokens; one round
    assert routing.score(long, 0) == pytest.approx(2.0 / (0.05 + 1000 * 0.002 / 200 + 1.2))
    assert long.plan[1][0] == 0, "worth its catch-up: MTP drafts the long request"
    assert routing.score(ending, 0) == pytest.approx(2.0 / (0.05 + 1000 * 0.002 + 1.2))
    assert ending.plan[1][0] == 2, "a round left: the catch-up is not repaid, the suffix member drafts"


def test_the_engine_spreads_each_requests_catch_up_over_its_own_tokens_left(monkeypatch):
    target, router, _ = priced_router()
    engine = SpeculativeEngine(target, router, policy="constant", max_batch_size=2)
    seen = []
    plan = RoutingPolicy.plan

    def spy(self, state, pending=None, tokens_left=None):
        seen.append(list(tokens_left))
        return plan(self, state, pending, tokens_left)

    monkeypatch.setattr(RoutingPolicy, "plan", spy)
    engine.generate(
        [Request([1, 2, 3], max_new_tokens=12, eos_token_id=[]), Request([4, 5], max_new_tokens=5, eos_token_id=[])]
    )
    first = seen[0]
    assert first == [12 - 1 - 1, 5 - 1 - 1], "after each prefill's token, each request's own tokens left"
    assert all(len(left) in (1, 2) for left in seen) and max(max(left) for left in seen) <= 10


def test_a_matching_suffix_member_drafts_even_where_its_bucket_record_loses_and_its_cut_decides():
    """Where no member's score beats decoding without drafts but the suffix member has a match, the suffix member
    drafts the round (its drafts are nearly free, and D-cut verifies none of them that would not pay), whatever its
    bucket's record says; without a match the round is skipped."""
    target, router, routing = priced_router(shared_index_max_tokens=0)
    state = router.new_draft_state(1)
    routing.member_seconds = [0.05, 0.1, 0.01]
    routing.admit(state, 0)
    for own in state.rows[0].members[:2]:  # MTP and DFly were tried and lose: below 1 token per second
        own.accepted, own.verified = 0.1, {2: 1.0}
    state.members[2].rows[0].extend([1, 2, 3, 4, 5, 1, 2, 3])
    bucket = int(3).bit_length()
    routing.bucket_record[2][bucket] = (0.0, {3: 1.0})  # the record at this bucket: nothing accepted
    assert routing.score(state.rows[0], 2, bucket) < 1.0 and routing.score(state.rows[0], 1) < 1.0
    assert routing.choice(state, 0) == (2, bucket, False)
    assert routing.plan(state) == pytest.approx(FREE_ROUND_GAIN)
    state.members[2].rows[0].extend([9])  # no earlier "9": no match, nothing worth a round
    routing.bucket_record[2][0] = (0.0, {0: 1.0})
    assert routing.choice(state, 0)[1] == 0
    assert routing.plan(state) < 0


def test_the_suffix_member_reads_the_backlog_before_the_router_weighs_it(monkeypatch):
    """Through rounds the router does not draft, the suffix member still reads what was verified (when the router is
    asked what the next round promises), so its outlook sees the prompt: otherwise a request that starts with no try
    due would be judged by an empty index and never drafted. The drafting round after reads each token once. Reading
    is the member's `read` (index updates), never a drafting call: only the round it drafts calls its `propose`."""
    target, router, routing = priced_router(shared_index_max_tokens=0)
    suffix_proposals = []
    propose = router.members[2].propose
    monkeypatch.setattr(router.members[2], "propose", lambda *a, **k: suffix_proposals.append(1) or propose(*a, **k))
    state = router.new_draft_state(1)
    text = [7, 8, 9, 10, 11, 12, 7, 8, 9]
    routing.plan(state, [text[:4]])
    routing.plan(state, [text])  # a skipped round: the backlog grew; only the new tokens are read
    assert state.members[2].rows[0].tokens == text
    assert router.outlooks(state, 0)[2] == int(3).bit_length()  # "7 8 9" matched earlier in the prompt
    states = target(torch.tensor([text]), output_hidden_states=True).hidden_states
    hidden = tuple(states[i] for i in router.target_hidden_state_indices())
    for row in state.rows:
        for own in row.members[:2]:
            own.tries = False  # no try due: the suffix member drafts this round
        row.admitted = True
    routing.plan(state, [text + [10]])  # the round's plan, as decoding makes it before drafting
    drafting = DraftRound(torch.ones(1), [False])
    ids, _ = router.propose(state, hidden, torch.tensor([text + [10]]), 3, choose=drafting)
    assert drafting.sources.tolist() == [2]  # D-cut reads the suffix member's calibration for this row
    assert len(suffix_proposals) == 1  # the plans before read the backlog without drafting calls
    assert state.members[2].rows[0].tokens == text + [10]  # the read-ahead is not read again
    assert ids[0].tolist() == [11, 12, 7]
    assert drafting.max_steps == 3  # D-cut's early exit weighs the suffix member's steps only
    assert len(state.rows[0].members[0].tokens) == len(text) + 1  # MTP still has everything to read
    routing.plan(state, [[11, 12]])  # two more verified: read ahead, and never matched as if twice
    assert router.outlooks(state, 0, [11, 12])[2] == int(6).bit_length()  # "7 8 9 10 11 12" seen before


def test_a_batch_of_new_requests_tries_each_member_on_one_request_at_a_time():
    """Requests admitted together do not all pay a try (each reads a whole prompt): one tries each member, the others
    go by its verdict, and once the try is judged the next new request may try again."""
    target, router, routing = priced_router(rows=(1, 4))
    state = router.new_draft_state(4)
    choices = [routing.choice(state, r) for r in range(4)]
    assert choices[0][2] and not any(trying for _, _, trying in choices[1:])
    assert [row.members[0].tries for row in state.rows] == [True, False, False, False]
    state.rows[0].last_member, state.rows[0].last_try = choices[0][0], True
    routing.record_acceptance(state, [3, 0, 0, 0], [3, 0, 0, 0])  # the try wins: no backoff
    state.add_rows(1)
    routing.bucket_record[2][0] = (0.0, {0: 1.0})  # the suffix member without a match accepts nothing: an idle round
    assert choices[0][0] == 0 and routing.choice(state, 4) == (0, None, True)  # MTP's try is judged: tried again
    assert not state.rows[4].members[1].tries  # DFly's first try (request 0's) is still to come


def test_a_members_record_prices_its_rounds_by_the_mean_verify_cost_not_the_cost_at_the_mean_depth():
    """Cuts that verify nothing on some rounds and seven drafts on others cost the mean of t_v over those rounds;
    on a machine whose verify of 4 or 8 tokens costs about what one of 2 or 3 does (as measured here), t_v at the
    mean depth would overprice them."""
    target = make_target("llama", num_hidden_layers=2)
    router = make_router(target)
    routing = routing_of(router)
    model = VerifyCostModel(rows=[1], tokens=[1, 2, 3, 4, 8], seconds=[[1.0, 1.6, 2.0, 1.5, 1.6]], context=0)
    routing.cost_model = model
    routing.member_seconds = [0.05, 0.1, 0.0]
    state = router.new_draft_state(1)
    row = state.rows[0]
    for verified, accepted in [(0, 0), (7, 3)] * 20:
        row.last_member, row.last_bucket = 2, 3
        routing.record_acceptance(state, [verified], [accepted])
    accepted, law = routing.bucket_record[2][3]
    assert sum(law.values()) == pytest.approx(1.0) and set(law) == {0, 7, 1}  # the prior's weight has decayed
    mean_cost = sum(weight * model(1, 1 + n) for n, weight in law.items())
    assert routing.score(row, 2, 3) == pytest.approx((1 + accepted) / mean_cost)
    depth = sum(weight * n for n, weight in law.items())
    assert mean_cost < model(1, 1 + depth)  # what pricing the mean depth would have charged


def test_a_try_waits_until_reading_the_backlog_costs_a_small_share_of_the_requests_decoding():
    """After a long prompt a try's catch-up (reading the prompt) would cost more than it could win back: it waits
    until the request has decoded long enough that the catch-up is at most TRY_SHARE of that time."""
    target, router, routing = priced_router()
    routing.member_read_seconds = [0.01, 0.01, None]  # MTP and DFly have caught up before: reading costs 0.01 s/token
    state = router.new_draft_state(1)
    row = state.rows[0]
    routing.admit(state, 0)
    row.prompt = row.read = 1000
    row.members[0].tokens = row.members[1].tokens = [0] * 1000  # the prompt, unread: about 10 s to read
    assert not routing.needs_try(row, 0) and routing.choice(state, 0)[0] == 2  # the suffix member drafts meanwhile
    needed = int(routing.catch_up_seconds_of(0, 1000) / (TRY_SHARE * 1.0)) + 1
    row.read = 1000 + needed
    assert routing.needs_try(row, 0) and routing.choice(state, 0) == (0, None, True)
    row.members[0].tokens = row.members[1].tokens = [0] * 10  # a short prompt: tried after two tokens
    row.read = row.prompt + 1
    assert not routing.needs_try(row, 0)
    row.read = row.prompt + 2
    assert routing.needs_try(row, 0)


def test_two_unlucky_rounds_do_not_sink_a_member_that_pays_below_decoding_without_drafts():
    """A request's record is the mean of its rounds with the member's record over requests as a prior of a few
    rounds, so a member that earns on average stays chosen after a short run of rejections (a running average with
    weight 0.3 dropped it below decoding without drafts, after which it never drafted again)."""
    target = make_target("llama", num_hidden_layers=2)
    router = make_router(target)
    routing = routing_of(router)
    # drafting pays from 0.3 tokens accepted per round: (1 + a) / (0.1 + 1.2) > 1 / 1.0
    routing.cost_model = VerifyCostModel(rows=[1], tokens=[1, 2], seconds=[[1.0, 1.2]], context=0)
    routing.member_seconds = [0.1, 0.2, 0.0]
    state = router.new_draft_state(2)
    plain = routing._rate(0.0, {0: 1.0}, 0.0)
    for verified, accepted in [(1, 1), (1, 0), (1, 1), (1, 1), (1, 0), (1, 1), (1, 1), (1, 0)] * 3:
        state.rows[0].last_member, state.rows[0].last_bucket = 0, None
        routing.record_acceptance(state, [verified, 0], [accepted, 0])
    assert routing.member_accepted[0] == pytest.approx(0.6, abs=0.1)
    row = state.rows[0]
    assert routing.score(row, 0) > plain
    for _ in range(2):  # two rejections in a row
        row.last_member, row.last_bucket = 0, None
        routing.record_acceptance(state, [1, 0], [0, 0])
    assert routing.score(row, 0) > plain
    fresh = state.rows[1]  # a request the member never drafted goes by the member's record over requests
    assert fresh.members[0].accepted is None and routing.score(fresh, 0) > plain
    for _ in range(30):  # but a member that keeps losing on a request is dropped there
        row.last_member, row.last_bucket = 0, None
        routing.record_acceptance(state, [1, 0], [0, 0])
    assert routing.score(row, 0) < plain


def test_a_rounds_rest_beyond_drafting_and_the_verify_forward_is_measured_and_priced(monkeypatch):
    """The verify profile times the target forward alone; the rest of a round (the generation loop, the policy,
    acceptance) is timed between rounds, less the router's drafting and the profiled forward, and every rate pays
    it. A round around a prefill of admitted requests, or longer than a forward (a stall), teaches nothing."""
    from angelspec_hf.generation import routing as routing_module

    target, router, routing = priced_router(rows=(1, 2))
    routing.member_seconds = [0.05, 0.1, 0.01]
    clock = iter([10.0, 11.8, 12.0, 13.9, 20.0, 30.0, 40.0])
    monkeypatch.setattr(routing_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    state = router.new_draft_state(1)

    def round_ending_at_next_call(drafting: float, drafts: int) -> None:
        state.round_drafting = drafting  # what `propose` adds up
        routing.record_acceptance(state, [drafts], [0])
        routing.plan(state)

    routing.plan(state)  # 10.0: the first round starts
    round_ending_at_next_call(0.2, 3)  # 11.8: 1.8 s = 0.2 drafting + t_v(4) = 1.3 + 0.3 rest
    assert routing.round_overhead == pytest.approx(0.3)
    plain = routing._rate(0.0, {0: 1.0}, 0.0)
    assert plain == pytest.approx(1 / (1.0 + 0.3))
    row = state.rows[0]
    row.members[1].accepted, row.members[1].verified = 1.0, {3: 1.0}
    assert routing.score(row, 1) == pytest.approx(2.0 / (0.1 + 1.3 + 0.3))
    round_ending_at_next_call(0.0, 0)  # 12.0: 0.2 s, shorter than a forward of one token: no rest to measure
    assert routing.round_overhead == pytest.approx(0.3)
    round_ending_at_next_call(0.5, 0)  # 13.9: 1.9 s = 0.5 + t_v(1) + 0.4
    assert routing.round_overhead == pytest.approx(0.7 * 0.3 + 0.3 * 0.4)
    round_ending_at_next_call(0.0, 3)  # 20.0: a stall longer than a forward is not averaged
    measured = routing.round_overhead
    state.add_rows(1)  # an admission between rounds: its prefill is no round's rest
    round_ending_at_next_call(0.0, 0)  # 30.0
    assert routing.round_overhead == measured and state.round_started == 30.0


def test_a_members_scores_are_scaled_by_what_its_rounds_delivered_of_their_promise(monkeypatch):
    """A request's record changes only on the rounds its member drafts, and a member is picked when its record is
    high, so its rounds deliver less than the record promised (a winner's curse); the router scales the member's
    tokens per round by the share delivered. A try's promise is not counted: it did not win the round. The share
    starts at 1, counted as a few rounds: one unlucky round does not shut the member out (it would never draft again
    to correct it)."""
    target, router, routing = priced_router()
    routing.member_seconds = [0.05, 0.1, 0.01]
    state = router.new_draft_state(1)
    row = state.rows[0]
    assert routing.delivery(1) == 1.0  # nothing known yet
    row.members[1].accepted, row.members[1].verified = 3.0, {3: 1.0}
    promised = routing.score(row, 1)
    tokens = torch.tensor([[1, 2]])
    hidden = tuple(torch.zeros(1, 2, target.config.hidden_size, dtype=target.dtype) for _ in router.hidden_indices)
    monkeypatch.setattr(routing, "choice", lambda state, r, pending=(): (1, None, False))  # DFly drafts the round
    routing.plan(state, [[1, 2]])
    router.propose(state, hidden, tokens, 3, DraftRound(torch.tensor([1.0]), [False]))
    assert row.promised == pytest.approx(1 + 3.0)  # DFly's record when chosen
    routing.record_acceptance(state, [3], [1])  # delivered 2 of the 4 tokens promised
    # one round moves the share from its prior (all delivered, counted as DELIVERY_PRIOR_ROUNDS rounds) by its weight
    first = 1 - 0.5 / (1 + DELIVERY_PRIOR_ROUNDS)
    assert row.promised is None and routing.delivery(1) == pytest.approx(first)
    row.members[1].accepted, row.members[1].verified = 3.0, {3: 1.0}
    routing.member_seconds = [0.05, 0.1, 0.01]  # the round measured DFly's drafting time; back to the one above
    assert routing.score(row, 1) == pytest.approx(promised * first)  # (1 + 3) · the share, for the same time
    row.last_member, row.last_try, row.promised = 1, True, 9.0  # a try: its promise is not the member's
    routing.record_acceptance(state, [3], [3])
    assert routing.delivery(1) == pytest.approx(first)
    for _ in range(59):  # rounds that keep delivering half of their promise: the share follows them
        row.last_member, row.promised = 1, 4.0
        routing.record_acceptance(state, [3], [1])
    assert 0.5 < routing.delivery(1) < 0.55
