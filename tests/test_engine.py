"""The batched engine: every request's output equals its own solo `generate()`, whatever shares the batch."""

import os
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import ARCHITECTURES, make_target
from oracles import BatchOracleDFly, BatchOracleMTP

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter, SuffixDrafter
from angelspec_hf.generation.draft_round import CDF_BLOCK, DraftRound, draw, draw_rows, inverse_cdf
from angelspec_hf.generation.engine import Request, SpeculativeEngine
from angelspec_hf.generation.verify_cost import VerifyCostModel


def make_drafter(kind, target, oracle=True):
    if kind == "mtp":
        return (BatchOracleMTP if oracle else AngelSpecMTPDrafter).from_target(
            target, num_depths=3, draft_vocab_size=48
        )
    return (BatchOracleDFly if oracle else DFlyDrafter).from_target(
        target, block_size=6, num_draft_layers=2, mask_token_id=5, num_target_layers_tapped=2, draft_vocab_size=48
    )


def greedy_round(values) -> DraftRound:
    """A one-row greedy drafting round whose steps drew their tokens at draft probabilities `values` (each step's
    greedy confidence: max q)."""
    drafting = DraftRound(torch.ones(1), sampled=[False])
    for value in values:
        probabilities = torch.full((1, 100), (1 - value) / 99)
        probabilities[0, 0] = value
        drafting.choose(probabilities.log())
    return drafting


def mixed_requests(vocab_size, count=7, seed=0):
    """Prompts of 1 to 40 tokens and length limits of 1 to 40 new tokens."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        prompt = [rng.randrange(vocab_size - 1) for _ in range(rng.choice([1, 3, 9, 17, 40]))]
        requests.append(Request(prompt, max_new_tokens=rng.choice([1, 5, 12, 25, 40]), request_id=index))
    return requests


def solo_outputs(target, requests):
    """Each request alone through plain `target.generate`, with the request's EOS tokens if it has its own."""
    outputs = {}
    for request in requests:
        ids = torch.tensor([request.input_ids])
        eos = {} if request.eos_token_id is None else {"eos_token_id": request.eos_token_id}
        out = target.generate(ids, max_new_tokens=request.max_new_tokens, do_sample=False, **eos)
        outputs[request.request_id] = out[0, ids.shape[1] :].tolist()
    return outputs


def flat_cost_model():
    """A verify cost that makes every extra verified token pay off, so D-cut verifies deep (a forward of 100 s makes
    the measured drafting time, which varies with the machine's load, negligible)."""
    return VerifyCostModel(rows=[1, 64], tokens=[1, 32], seconds=[[100.0, 100.1], [100.0, 100.1]], context=128)


@pytest.mark.parametrize("policy", ["constant-3", "dcut"])
@pytest.mark.parametrize("kind", ["mtp", "dfly"])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_each_request_matches_its_solo_generate(model_type, kind, policy, dcut_always_drafts):
    """Mixed prompt lengths and limits, early EOS, and more requests than rows (requests join mid-flight)."""
    target = make_target(model_type, num_hidden_layers=3)
    requests = mixed_requests(target.config.vocab_size, count=9, seed=ARCHITECTURES.index(model_type))
    # Some requests get their own EOS: a token their free-running output emits early, so they stop there.
    free_running = solo_outputs(target, requests)
    for request in requests[::3]:
        if len(free_running[request.request_id]) > 3:
            request.eos_token_id = [target.config.eos_token_id, free_running[request.request_id][2]]
    references = solo_outputs(target, requests)
    drafter = make_drafter(kind, target)
    engine = SpeculativeEngine(target, drafter, policy=policy, max_batch_size=4, cost_model=flat_cost_model())
    drafter.engine, drafter.references, drafter.rng = engine, references, random.Random(0)
    outputs = engine.generate(requests)
    for request, output in zip(requests, outputs):
        assert output.output_ids == references[request.request_id], f"request {request.request_id} diverged"
        assert output.finish_reason in ("eos", "length")
    assert "eos" in {o.finish_reason for o in outputs}  # some request stopped early
    accepted = [sum(o.stats.accepted) for o in outputs]
    assert sum(accepted) > 20 and len(set(accepted)) > 2  # rows really accepted different amounts
    assert engine.stats.peak_rows == 4


def test_batched_autoregressive_baseline_matches_generate():
    target = make_target("qwen3", num_hidden_layers=2)
    requests = mixed_requests(target.config.vocab_size, count=6, seed=3)
    references = solo_outputs(target, requests)
    outputs = SpeculativeEngine(target, None, max_batch_size=3).generate(requests)
    assert [o.output_ids for o in outputs] == [references[r.request_id] for r in requests]


def test_greedy_requests_batched_with_sampled_ones_match_their_solo_generate():
    """The target's argmax is taken only when a row decodes greedily: in a batch that mixes both, greedy rows are
    still exactly `generate`'s, and a batch of sampled rows alone still decodes."""
    target = make_target("llama", num_hidden_layers=2)
    greedy = mixed_requests(target.config.vocab_size, count=4, seed=5)
    references = solo_outputs(target, greedy)
    sampled = [
        Request(r.input_ids, max_new_tokens=12, eos_token_id=[], do_sample=True, seed=k) for k, r in enumerate(greedy)
    ]
    outputs = SpeculativeEngine(target, None, max_batch_size=8).generate([*greedy, *sampled])
    assert [o.output_ids for o in outputs[:4]] == [references[r.request_id] for r in greedy]
    alone = SpeculativeEngine(target, None, max_batch_size=8).generate(sampled)
    assert [len(o.output_ids) for o in alone] == [12] * 4


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_samples_of_one_prompt_share_its_prefill_and_each_is_what_it_would_be_alone(kind, dcut_always_drafts):
    """Several samples of a prompt (best-of-n, rollouts): with kept prefills each prompt is prefilled once, and every
    output — greedy, or sampled with its seed as an API's `seed` promises (`reproducible`: otherwise the draws depend
    on what was drafted) — is the one the engine gives without them, token for token."""
    target = make_target("llama", num_hidden_layers=2)
    prompts = [r.input_ids for r in mixed_requests(target.config.vocab_size, count=3, seed=7)]
    requests = [
        Request(prompt, max_new_tokens=12, do_sample=sample > 0, seed=100 * sample + p, reproducible=sample > 0)
        for p, prompt in enumerate(prompts)
        for sample in range(4)
    ]

    def served(prompt_cache_tokens):
        drafter = make_drafter(kind, target, oracle=False)
        engine = SpeculativeEngine(
            target,
            drafter,
            max_batch_size=3,
            cost_model=flat_cost_model(),
            prompt_cache_tokens=prompt_cache_tokens,
        )
        return engine.generate(requests), engine.stats

    plain, plain_stats = served(0)
    shared, shared_stats = served(2 * max(len(prompt) for prompt in prompts))
    assert [o.output_ids for o in shared] == [o.output_ids for o in plain]
    assert plain_stats.reused_prefills == 0 and shared_stats.reused_prefills == len(requests) - len(prompts)
    assert sum(sum(o.stats.accepted) for o in shared) > 0, "drafts were verified"
    assert len({tuple(o.output_ids) for o in shared}) > len(prompts), "the samples differ"


def test_kept_prefills_stay_within_their_token_budget_least_recent_first():
    from angelspec_hf.cache_utils import RaggedCache
    from angelspec_hf.generation.engine import PromptPrefills

    kept = PromptPrefills(max_tokens=10)
    cache = RaggedCache(1)
    cache.append(torch.ones(1, 4, dtype=torch.bool))
    logits = torch.zeros(1, 8)
    kept.put((1, 2, 3, 4), cache, logits, None)
    kept.put((5, 6, 7), cache, logits, None)
    assert kept.get((1, 2, 3, 4)) is not None  # now the most recent
    kept.put((8, 9, 10, 11), cache, logits, None)  # 11 tokens: the least recent, (5, 6, 7), leaves
    assert kept.get((5, 6, 7)) is None and kept.tokens == 8
    kept.put(tuple(range(11)), cache, logits, None)  # longer than the whole budget: not kept
    assert kept.tokens == 8
    copy = kept.get((8, 9, 10, 11))[0]
    copy.valid[0, 0] = False
    assert kept.get((8, 9, 10, 11))[0].valid.all(), "each request gets its own copy"
    with pytest.raises(ValueError, match="prompt_cache_tokens must be a non-negative integer"):
        SpeculativeEngine(make_target("llama", num_hidden_layers=1), prompt_cache_tokens=-1)


def test_cancelled_requests_leave_the_queue_and_the_batch_and_the_others_are_unchanged(dcut_always_drafts):
    """A server's client going away: a running and a waiting request cancelled between steps."""
    target = make_target("llama", num_hidden_layers=2)
    requests = [Request(r.input_ids, max_new_tokens=30, request_id=r.request_id) for r in mixed_requests(96, count=5)]
    references = solo_outputs(target, requests)
    drafter = SuffixDrafter.from_target(target)
    engine = SpeculativeEngine(target, drafter, max_batch_size=2, cost_model=flat_cost_model())
    outputs = [engine.submit(request) for request in requests]
    engine.step()
    running, waiting = outputs[0], outputs[3]
    engine.cancel(running)
    engine.cancel(waiting)
    cut_at = len(running.output_ids)
    while engine.has_unfinished():
        engine.step()
    assert running.finish_reason == waiting.finish_reason == "cancelled"
    assert len(running.output_ids) == cut_at and waiting.output_ids == []
    for request, output in zip(requests, outputs):
        if output not in (running, waiting):
            assert output.output_ids == references[request.request_id] and output.finish_reason in ("eos", "length")
    # Only whole answers are kept in the suffix drafter's index of served outputs.
    whole = [o.output_ids for o in outputs if o.finish_reason != "cancelled"]
    key = drafter.shared_index.key_length
    assert sorted(drafter.shared_index.sequences) == sorted(ids for ids in whole if len(ids) > key) != []


def test_untrained_drafter_with_dcut_is_lossless_and_reports_stats(dcut_always_drafts):
    target = make_target("llama", num_hidden_layers=2)
    requests = mixed_requests(target.config.vocab_size, count=5, seed=5)
    references = solo_outputs(target, requests)
    drafter = make_drafter("mtp", target, oracle=False)
    engine = SpeculativeEngine(target, drafter, max_batch_size=8, cost_model=flat_cost_model())
    outputs = engine.generate(requests)
    assert [o.output_ids for o in outputs] == [references[r.request_id] for r in requests]
    assert engine.stats.generated_tokens == sum(len(o.output_ids) for o in outputs)
    assert engine.stats.peak_cache_bytes > 0 and engine.stats.rounds > 0


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_dcut_skips_drafting_when_verification_cannot_pay(kind, monkeypatch):
    """A cost model where a verified draft quadruples the cost: after a first drafting round (pinned here) D-cut
    expects no draft to pay, a probe never fits in its exploration share, and it decodes as AR — while requests
    leave and join rows whose drafter has not run yet."""
    from angelspec_hf.generation.policies import DCut

    first_round = iter([True])
    monkeypatch.setattr(DCut, "drafting_pays", lambda self, budget, backlog: next(first_round, False))
    target = make_target("llama", num_hidden_layers=2)
    requests = mixed_requests(target.config.vocab_size, count=9, seed=2)
    # The rows of the first (drafting) round leave before any later round, while a row that joined meanwhile stays:
    # the drafter's cache then holds only holes, compacts to no columns, and more rows join it.
    for request, limit in zip(requests, [2, 5, 5] + [24] * 6):
        request.max_new_tokens = limit
        request.eos_token_id = -1  # no early stop: the limits above decide who leaves when
    references = solo_outputs(target, requests)
    steep = VerifyCostModel(rows=[1], tokens=[1, 2, 32], seconds=[[1.0, 4.0, 128.0]], context=128)
    engine = SpeculativeEngine(target, make_drafter(kind, target, oracle=False), max_batch_size=3, cost_model=steep)
    proposals = []
    original_propose = engine.drafter.propose
    monkeypatch.setattr(engine.drafter, "propose", lambda *a, **k: proposals.append(1) or original_propose(*a, **k))
    outputs = engine.generate(requests)
    assert [o.output_ids for o in outputs] == [references[r.request_id] for r in requests]
    assert len(proposals) == 1 and engine.stats.skipped_drafts > 10
    assert all(sum(o.stats.drafted) == 0 for o in outputs)


def test_dcut_drafts_when_its_estimates_say_drafting_pays_and_the_catch_up_is_repaid():
    """g > 0 under the profile: a round drafts unless the drafter's backlog costs more than g repays in the rounds
    left; drafting that cannot pay is not chosen for the catch-up either."""
    from angelspec_hf.generation.policies import DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 4, 64], seconds=[[1.0, 1.1, 1.2, 8.0]], context=0)
    policy = DCut(3, cost_model=profile)
    policy.estimates = DrafterEstimates(read_ratio=0.5, depth_confidence=torch.tensor([0.8, 0.6, 0.4]))
    row = [policy.new_row()]
    policy.first_draft_seconds = 0.05
    assert policy.draft_count(row, budget=100, backlog=4) == 3  # no catch-up beyond a usual round: drafts
    assert policy.saved_fraction(0.05) == pytest.approx(1 - 1 / (2.8 / 1.25))
    assert policy.draft_count(row, budget=100, backlog=64) == 3  # catch-up 0.5 × (8 − 1.2) s, repaid over 100 rounds
    assert policy.draft_count(row, budget=2, backlog=64) == 0  # not in 2 rounds, and no room to explore
    policy.estimates.depth_confidence = torch.tensor([0.01, 0.0, 0.0])
    assert policy.saved_fraction(0.05) < 0 and policy.draft_count(row, budget=100, backlog=4) == 0


def test_dcut_keeps_what_drafting_saved_per_batch_size():
    """A drafter that saves 30 % of a round alone does not draft at once in a batch of 16, where verifying its
    drafts costs far more: that batch size's first rounds read the mean confidences, not the lone rows' ĝ."""
    from angelspec_hf.generation.policies import DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1, 16], tokens=[1, 2, 4], seconds=[[1.0, 1.05, 1.1], [2.0, 3.5, 5.0]], context=0)
    policy = DCut(3, cost_model=profile)
    policy.estimates = DrafterEstimates(
        read_ratio=0.0, depth_confidence=torch.tensor([0.4, 0.2, 0.1]), drafting_gain={1: 0.3}
    )
    policy.first_draft_seconds = 0.01
    assert policy.draft_count([policy.new_row()], budget=100, backlog=4) == 3
    assert policy.saved_fraction(0.01) == 0.3
    assert policy.draft_count([policy.new_row() for _ in range(16)], budget=100, backlog=4) == 0
    assert policy.saved_fraction(0.01) < 0 and policy.estimates.drafting_gain == {1: 0.3}


def test_a_promised_round_drafts_in_a_batch_only_while_that_batch_size_s_drafting_rounds_pay():
    """A drafter that reads for free promises a round whenever a row has a match; alone the promise stands, in a
    batch of 4 it stands while the rounds drafted at that size have not lost time on average (ĝ ≥ 0)."""
    from angelspec_hf.generation.dcut import FREE_ROUND_GAIN
    from angelspec_hf.generation.policies import DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1, 4], tokens=[1, 2, 4], seconds=[[1.0, 1.05, 1.1], [2.0, 2.5, 3.0]], context=0)

    def drafts(rows, gains):
        policy = DCut(3, cost_model=profile)
        policy.estimates = DrafterEstimates(
            read_ratio=0.0, depth_confidence=torch.tensor([0.5, 0.3, 0.2]), drafting_gain=gains
        )
        policy.first_draft_seconds = 0.01
        batch = [policy.new_row() for _ in range(rows)]
        return policy.draft_count(batch, budget=100, backlog=4, promised_gain=FREE_ROUND_GAIN)

    assert drafts(1, {1: -0.05}) == 3
    assert drafts(4, {4: -0.05}) == 0
    assert drafts(4, {4: 0.02}) == 3 and drafts(4, {1: -0.05}) == 3


def test_dcut_prices_drafting_by_what_its_cuts_promised_not_by_the_mean_confidence():
    """A drafter sure on one round in three and lost on the others (suffix matches): the mean confidence per depth
    does not pay for a wider verify, but each round's cut verifies only the sure rounds, so ĝ, the average saving
    those cuts promised, is positive and D-cut keeps drafting. A drafter lost on every round is priced below 0."""
    from angelspec_hf.generation.policies import DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 4], seconds=[[1.0, 1.5, 2.0]], context=0)

    def run(sure_every):
        policy = DCut(3, cost_model=profile)
        policy.estimates = DrafterEstimates(read_ratio=0.0)
        row = [policy.new_row()]
        for round_index in range(30):
            policy.draft_count(row, budget=100, backlog=4)
            sure = (round_index + 1) % sure_every == 0
            drafting = greedy_round([0.95, 0.9, 0.85] if sure else [0.02, 0.015, 0.012])
            policy.depths(drafting, [3], row, draft_seconds=0.01)
        return policy

    mostly_lost = run(sure_every=3)
    assert mostly_lost.estimates.depth_confidence[0] < 0.5  # 1 + ĉ_1 < t_v(2) / t_v(1): the mean would not pay
    assert mostly_lost.estimates.drafting_gain[1] > 0.05 and mostly_lost.drafting_pays(budget=100, backlog=4)
    always_lost = run(sure_every=10**6)
    assert always_lost.estimates.drafting_gain[1] < 0 and not always_lost.drafting_pays(budget=100, backlog=4)


def test_one_first_round_whose_cut_kept_little_does_not_stop_a_drafter_its_confidences_say_pays():
    """ĝ's first measurement averages with the g the mean confidences promise: a drafter whose prior says drafting
    saves a fifth of a round keeps drafting after one round sure of nothing, and a run of such rounds stops it."""
    from angelspec_hf.generation.policies import DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 4], seconds=[[1.0, 1.05, 1.1]], context=0)
    policy = DCut(3, cost_model=profile)
    policy.estimates = DrafterEstimates(read_ratio=0.0, depth_confidence=torch.tensor([0.6, 0.4, 0.2]))
    policy.first_draft_seconds = 0.01
    row = [policy.new_row()]
    assert policy.draft_count(row, budget=100, backlog=4) == 3
    promised = policy.saved_fraction(0.01)
    assert promised > 0.2

    def unsure_round():
        assert policy.draft_count(row, budget=100, backlog=4) == 3
        policy.depths(
            greedy_round([0.01] * 3), [3], row, draft_seconds=0.5
        )  # a slow round that verified nothing: g < 0 alone

    unsure_round()
    assert 0 < policy.estimates.drafting_gain[1] < promised and policy.drafting_pays(budget=100, backlog=4)
    for _ in range(10):
        if not policy.drafting_pays(budget=100, backlog=4):
            break
        unsure_round()
    assert policy.estimates.drafting_gain[1] < 0 and not policy.drafting_pays(budget=100, backlog=4)


def test_a_few_unsure_rounds_after_many_good_ones_do_not_stop_a_drafter_that_pays():
    """ĝ averages the drafting rounds' g over about GAIN_WINDOW no-draft rounds' worth of their tokens: three rounds
    that verify nothing and cost a whole round after twenty good ones leave ĝ above 0 (an average over five rounds
    fell below it), and a long run of them stops drafting."""
    from angelspec_hf.generation.policies import GAIN_WINDOW, DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 4], seconds=[[1.0, 1.05, 1.1]], context=0)
    policy = DCut(3, cost_model=profile)
    policy.estimates = DrafterEstimates(read_ratio=0.0, depth_confidence=torch.tensor([0.3, 0.1, 0.05]))
    policy.first_draft_seconds = 0.01
    row = [policy.new_row()]

    def drafting_round(value, draft_seconds):
        policy.draft_count(row, budget=100, backlog=4)
        policy.depths(greedy_round([value] * 3), [3], row, draft_seconds=draft_seconds)

    for _ in range(20):
        drafting_round(0.9, draft_seconds=0.05)  # three drafts verified, g ≈ 0.67
    assert policy.estimates.gain_weight[1] == GAIN_WINDOW
    good = policy.estimates.drafting_gain[1]
    assert good > 0.5
    for _ in range(3):
        drafting_round(0.01, draft_seconds=1.0)  # verified nothing and cost a whole round: g = -1
    assert 0.25 < policy.estimates.drafting_gain[1] < good and policy.drafting_pays(budget=100, backlog=4)
    for _ in range(30):
        if not policy.drafting_pays(budget=100, backlog=4):
            break
        drafting_round(0.01, draft_seconds=1.0)
    assert policy.estimates.drafting_gain[1] < 0 and not policy.drafting_pays(budget=100, backlog=4)


def test_dcut_gain_is_the_share_of_time_saved_not_the_mean_of_the_rounds_saved_fractions():
    """Rounds sure of three drafts (g ≈ 0.63) alternating with rounds sure of none (g = -0.35): together they save
    1 − Σ t / Σ t_0 ≈ 43 % of the time no-draft rounds would take for their tokens, and ĝ says so, where the mean
    of their g (14 %) would price the drafter at a third of what it saves."""
    from angelspec_hf.generation.policies import DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 4], seconds=[[1.0, 1.05, 1.1]], context=0)
    policy = DCut(3, cost_model=profile)
    policy.estimates = DrafterEstimates(read_ratio=0.0)
    row = [policy.new_row()]
    for index in range(200):
        policy.draft_count(row, budget=100, backlog=4)
        policy.depths(greedy_round([0.99 if index % 2 == 0 else 0.01] * 3), [3], row, draft_seconds=0.35)
    sure = sum(0.99**k for k in range(4))  # the bonus token and c_k = 0.99^k (the calibrator not yet fitted)
    shared = 1 - (0.35 + 1.1 + 0.35 + 1.0) / (sure + 1)
    assert abs(policy.estimates.drafting_gain[1] - shared) < 0.05


def test_dcut_explores_an_unknown_drafter_early_and_reprobes_within_its_share():
    """An unknown drafter is tried in the first round when the whole run affords it; a known one that does not pay
    is re-probed only as the run's time allows, never spending more than EXPLORATION_SHARE of it."""
    from angelspec_hf.generation.policies import EXPLORATION_SHARE, DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 4], seconds=[[1.0, 1.5, 2.5]], context=0)
    policy = DCut(3, cost_model=profile)
    policy.estimates = DrafterEstimates(read_ratio=0.01)
    row = [policy.new_row()]
    assert policy.draft_count(row, budget=3, backlog=2) == 0  # 4 rounds cannot afford a 0.5 s probe
    assert policy.draft_count(row, budget=200, backlog=2) == 3 and policy.exploring
    policy.estimates.depth_confidence = torch.zeros(3, dtype=torch.float64)  # it did not pay
    probes = [left for left in range(199, 0, -1) if policy.draft_count(row, budget=left, backlog=2)]
    estimates = policy.estimates
    assert len(probes) >= 3 and estimates.explored_seconds <= EXPLORATION_SHARE * estimates.decoded_seconds
    gaps = [earlier - later for earlier, later in zip(probes, probes[1:])]
    assert min(gaps) >= 20  # spread over the run, not spent at once


def test_dcut_reprobes_a_drafter_whose_probe_costs_more_than_one_run_affords():
    """The exploration account spans runs (the drafter's memory): a probe that reads a long backlog costs more than
    2 % of one short run, so runs priced alone never probed again; over several runs it is afforded, spaced, and
    a long stretch of paying rounds banks no burst of probes."""
    from angelspec_hf.generation.policies import EXPLORATION_SHARE, DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 4, 64], seconds=[[1.0, 1.5, 2.5, 4.0]], context=0)
    estimates = DrafterEstimates(read_ratio=0.5, depth_confidence=torch.zeros(3, dtype=torch.float64))
    probed_runs = []
    # runs of 30 rounds (30 s at the no-draft cost); a probe costs 2.5 s, 0.75 s of it the backlog
    for run in range(12):
        policy = DCut(3, cost_model=profile)
        policy.estimates = estimates
        row = [policy.new_row()]
        probes = [left for left in range(30, 0, -1) if policy.draft_count(row, budget=left, backlog=64)]
        assert EXPLORATION_SHARE * 30 < 2.5 and len(probes) <= 1
        probed_runs += [run] * len(probes)
    assert len(probed_runs) >= 2 and min(b - a for a, b in zip(probed_runs, probed_runs[1:])) >= 2
    assert estimates.explored_seconds <= EXPLORATION_SHARE * estimates.decoded_seconds
    estimates.decoded_seconds += 10_000.0  # a long stretch of paying rounds
    policy = DCut(3, cost_model=profile)
    policy.estimates = estimates
    row = [policy.new_row()]
    assert sum(1 for left in range(30, 0, -1) if policy.draft_count(row, budget=left, backlog=64)) <= 2


def test_a_dcut_probe_verifies_a_first_draft_its_cut_would_drop():
    """An exploration round verifies each drafting row's first draft whatever its confidences (they are what the
    probe corrects; cut to nothing it teaches the calibrator nothing); the same round not exploring verifies none."""
    from angelspec_hf.generation.policies import DCut, DrafterEstimates

    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 4], seconds=[[1.0, 1.5, 2.5]], context=0)
    policy = DCut(3, cost_model=profile)
    policy.estimates = DrafterEstimates(read_ratio=0.01)
    row = [policy.new_row()]
    assert policy.draft_count(row, budget=200, backlog=2) == 3 and policy.exploring
    assert policy.depths(greedy_round([0.02, 0.02, 0.02]), caps=[3], rows=row, draft_seconds=0.01) == [1]
    policy.exploring = False  # the same round, drafted because it was expected to pay
    assert policy.depths(greedy_round([0.02, 0.02, 0.02]), caps=[3], rows=row, draft_seconds=0.01) == [0]
    assert policy.depths(greedy_round([0.02]), caps=[0], rows=row, draft_seconds=0.01) == [0]  # a row with no cap


def test_dcut_estimate_keeps_positions_the_early_exit_did_not_reach():
    """A round that drafted one position must not read as zero confidence at the depths it did not draft (else
    D-cut talks itself out of drafting); estimates never grow with depth."""
    from angelspec_hf.generation.policies import DCut, DrafterEstimates

    usual, backlog = (
        SimpleNamespace(reads_backlog=flag, read_width=width, first_step_seconds=lambda: 0.01)
        for flag, width in ((False, 4), (True, 32))
    )
    policy = DCut(3, cost_model=flat_cost_model())
    policy.estimates = DrafterEstimates(read_ratio=0.1)
    policy._record_drafting(torch.tensor([[0.6, 0.3, 0.2], [0.4, 0.1, 0.0]], dtype=torch.float64), usual)
    assert torch.allclose(policy.depth_confidence, torch.tensor([0.5, 0.2, 0.1], dtype=torch.float64))
    policy._record_drafting(torch.tensor([[0.0]], dtype=torch.float64), usual)  # early exit after depth 1
    assert torch.allclose(policy.depth_confidence, torch.tensor([0.4, 0.2, 0.1], dtype=torch.float64))
    policy._record_drafting(torch.tensor([[0.0]], dtype=torch.float64), usual)
    policy._record_drafting(torch.tensor([[0.0]], dtype=torch.float64), usual)
    assert policy.depth_confidence.tolist() == sorted(policy.depth_confidence.tolist(), reverse=True)
    assert policy.depth_confidence[2] > 0
    fresh = DCut(3, cost_model=flat_cost_model())
    fresh.estimates = DrafterEstimates(read_ratio=0.1)
    fresh._record_drafting(
        torch.tensor([[0.7]], dtype=torch.float64), backlog
    )  # first round: deeper positions start there
    assert fresh.depth_confidence.tolist() == pytest.approx([0.7, 0.7, 0.7])
    assert fresh.first_draft_seconds is None and policy.first_draft_seconds == pytest.approx(0.01)
    assert fresh.estimates.read_ratio == pytest.approx(0.5 * 0.1 + 0.5 * 0.01 / 100.1)  # measured on the backlog


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_rounds_without_drafting_leave_the_drafter_a_backlog_it_reads_at_once(kind, monkeypatch):
    """Skipped rounds do not run the drafter; the next drafting round reads every token they verified in one call,
    and drafts what a drafter that read them round by round drafts at the same point of the same request."""
    target = make_target("llama", num_hidden_layers=2)
    requests = mixed_requests(target.config.vocab_size, count=4, seed=11)

    def drafts_by_point(skip_pattern):
        torch.manual_seed(0)  # the same drafter weights in both runs
        drafter = make_drafter(kind, target, oracle=False)
        engine = SpeculativeEngine(target, drafter, max_batch_size=4, cost_model=flat_cost_model())
        calls = {"rounds": 0, "proposals": 0}
        original_propose = drafter.propose

        def counting_propose(*args, **kwargs):
            calls["proposals"] += 1
            return original_propose(*args, **kwargs)

        def pay(budget, backlog):
            calls["rounds"] += 1
            return skip_pattern(calls["rounds"])

        monkeypatch.setattr(drafter, "propose", counting_propose)
        monkeypatch.setattr(engine.session.policy, "drafting_pays", pay)
        monkeypatch.setattr(engine.session.policy, "may_explore", lambda count, budget, backlog: False)
        seen = {}
        original_draft = engine._draft

        def recording_draft():
            before = [(row.request.request_id, len(row.output.output_ids)) for row in engine.rows]
            drafts, logits, probabilities = original_draft()
            for point, row_drafts in zip(before, drafts.tolist()):
                if row_drafts:
                    seen[point] = row_drafts
            return drafts, logits, probabilities

        monkeypatch.setattr(engine, "_draft", recording_draft)
        outputs = engine.generate(requests)
        return seen, [o.output_ids for o in outputs], calls

    every_round, outputs, calls = drafts_by_point(lambda round_: True)
    sparse, sparse_outputs, sparse_calls = drafts_by_point(lambda round_: round_ % 4 == 0)
    assert sparse_outputs == outputs
    assert sparse_calls["proposals"] < sparse_calls["rounds"] / 2  # skipped rounds did not run the drafter
    common = set(every_round) & set(sparse)
    assert len(common) >= 4
    for point in common:  # how many tokens a round drafts depends on the batch around it: compare the common part
        length = min(len(sparse[point]), len(every_round[point]))
        assert sparse[point][:length] == every_round[point][:length], point


WINDOWED = {  # sliding-window attention on every layer (Mistral) or on the second of two (Qwen2's layer_types)
    "mistral": dict(sliding_window=4),
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
}


@pytest.mark.chi2
def test_rows_sampled_without_drafts_follow_each_requests_own_law():
    """Rows that verify no draft draw together, one softmax and CDF per sampling setting (`_draw_undrafted`): the
    second token of continuations sampled in batches that mix two settings, each against its exact law."""
    from scipy.stats import chisquare

    target = make_target("llama", vocab_size=24, num_hidden_layers=2)
    target.lm_head.weight.div_(4.0)  # flatter distribution: many outcomes
    prompt = [3, 9, 4, 11, 2, 17, 6]
    settings = [dict(temperature=0.9), dict(temperature=0.6, top_k=8)]

    def law(ids, temperature, top_k=None):
        logits = target(torch.tensor([ids])).logits[0, -1] / temperature
        if top_k is not None:
            logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
        return logits.softmax(-1)

    requests = [
        Request(prompt, max_new_tokens=2, eos_token_id=[], do_sample=True, seed=s, **settings[s % 2])
        for s in range(3000)
    ]
    outputs = SpeculativeEngine(target, max_batch_size=64).generate(requests)
    with torch.no_grad():
        for k, setting in enumerate(settings):
            first = law(prompt, **setting)
            following = torch.stack([law(prompt + [x], **setting) for x in range(first.numel())])
            expected = (first[:, None] * following).sum(0)
            second = torch.tensor([o.output_ids[1] for o in outputs[k::2]])
            observed = torch.bincount(second, minlength=expected.numel()).double()
            assert observed[expected == 0].sum() == 0  # top-k's excluded tokens never come
            keep = expected * len(second) > 5
            assert (
                chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue > 1e-3
            )


def test_draw_rows_gives_each_row_what_draw_gives_it_alone():
    probabilities = torch.rand(6, 50).softmax(-1)
    alone = [draw(p, torch.Generator().manual_seed(r)) for r, p in enumerate(probabilities)]
    together = draw_rows(probabilities, [torch.Generator().manual_seed(r) for r in range(6)])
    assert together == alone


def test_inverse_cdf_in_blocks_is_the_inverse_of_the_whole_cdf():
    """The two-level inversion picks the token the float64 CDF over the whole vocabulary picks, for a vocabulary
    that is not a multiple of the block, with top-k zeros among the tokens."""
    generator = torch.Generator().manual_seed(0)
    probabilities = torch.rand(64, 1000, generator=generator) ** 4
    probabilities[probabilities < 0.2] = 0  # most tokens excluded, as a top-k or top-p warper leaves them
    probabilities /= probabilities.sum(-1, keepdim=True)
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
    cdf = probabilities.double().cumsum(-1)
    whole = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    assert inverse_cdf(probabilities, uniforms).tolist() == whole.tolist()


def test_inverse_cdf_never_gives_a_token_of_zero_probability():
    """At the extreme uniforms (0 and the largest float64 below 1), with zero blocks inside and after the mass."""
    probabilities = torch.zeros(3, 3 * CDF_BLOCK + 7)
    probabilities[0, 5] = 1.0  # one token
    probabilities[1, [3, CDF_BLOCK * 2 + 1]] = torch.tensor([0.25, 0.75])  # an empty block between two masses
    probabilities[2, : CDF_BLOCK + 1] = 1 / (CDF_BLOCK + 1)  # the last positive token opens a block
    for u in (0.0, 1.0 - 2.0**-53):
        tokens = inverse_cdf(probabilities, torch.full((3,), u, dtype=torch.float64))
        assert (probabilities.gather(1, tokens[:, None]) > 0).all(), (u, tokens)
    assert inverse_cdf(probabilities, torch.full((3,), 1.0 - 2.0**-53, dtype=torch.float64)).tolist() == [
        5,
        CDF_BLOCK * 2 + 1,
        CDF_BLOCK,
    ]


@pytest.mark.chi2
@pytest.mark.parametrize("model_type", ["llama", *WINDOWED])
def test_sampling_preserves_the_target_distribution(model_type):
    """The second token (the first one a verify round decides) of many sampled continuations vs its exact law
    under the target, sum over x1 of p(x1) p(x2 | x1); on the windowed targets the prompt is longer than the window."""
    from scipy.stats import chisquare

    target = make_target(model_type, vocab_size=24, num_hidden_layers=2, **WINDOWED.get(model_type, {}))
    target.lm_head.weight.div_(4.0)  # flatter distribution: many outcomes
    drafter = AngelSpecMTPDrafter.from_target(target, num_depths=2)
    prompt, temperature = [3, 9, 4, 11, 2, 17, 6], 0.9
    requests = [
        Request(prompt, max_new_tokens=3, eos_token_id=[], do_sample=True, temperature=temperature, seed=s)
        for s in range(1500)
    ]
    engine = SpeculativeEngine(target, drafter, policy="constant-2", max_batch_size=64)
    outputs = engine.generate(requests)
    first = (target(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
    following = torch.stack(
        [(target(torch.tensor([prompt + [x]])).logits[0, -1] / temperature).softmax(-1) for x in range(first.numel())]
    )
    expected = (first[:, None] * following).sum(0) * len(outputs)
    observed = torch.bincount(torch.tensor([o.output_ids[1] for o in outputs]), minlength=expected.numel()).double()
    keep = expected > 5
    assert chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue > 1e-3
    assert sum(sum(o.stats.accepted) for o in outputs) > 100  # drafts were accepted and rejected


def test_impossible_requests_are_rejected_while_the_others_run(package_log):
    target = make_target("llama", num_hidden_layers=2, max_position_embeddings=64)
    good = Request([1, 2, 3], max_new_tokens=8)
    too_long = Request(list(range(1, 50)), max_new_tokens=30)
    empty = Request([], max_new_tokens=4)
    with package_log.warns("rejected"):
        outputs = SpeculativeEngine(target, None).generate([too_long, good, empty])
    assert outputs[0].finish_reason == "error" and "context of 64" in outputs[0].error
    assert outputs[2].finish_reason == "error" and "empty prompt" in outputs[2].error
    assert outputs[1].finish_reason in ("eos", "length")
    assert outputs[1].output_ids == solo_outputs(target, [good])[good.request_id]


def test_requests_beyond_the_memory_budget_are_queued_not_crashed():
    target = make_target("llama", num_hidden_layers=2)
    requests = [Request([3 + i, 4, 5 + i], max_new_tokens=12, request_id=i) for i in range(6)]
    references = solo_outputs(target, requests)
    engine = SpeculativeEngine(target, None, max_batch_size=6)
    one_row = 2 * (max(len(r.input_ids) + r.max_new_tokens for r in requests) + 1) * engine.bytes_per_token
    engine.memory_budget_bytes = 2 * one_row  # room for two rows at a time
    outputs = engine.generate(requests)
    assert [o.output_ids for o in outputs] == [references[r.request_id] for r in requests]
    assert engine.stats.peak_rows <= 2


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_generate_with_a_batch_runs_the_engine(kind):
    """`target.generate(left-padded batch, attention_mask, assistant_model=drafter)` equals each row's solo generate."""
    target = make_target("mistral", num_hidden_layers=2)
    drafter = make_drafter(kind, target, oracle=False)
    prompts = [[5, 6, 7, 8, 9], [11], [20, 21, 22]]
    width = max(map(len, prompts))
    pad = target.config.pad_token_id
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    output = target.generate(batch, attention_mask=mask, max_new_tokens=15, do_sample=False, assistant_model=drafter)
    for row, prompt in enumerate(prompts):
        solo = target.generate(torch.tensor([prompt]), max_new_tokens=15, do_sample=False)[0, len(prompt) :].tolist()
        generated = output[row, width:].tolist()
        assert generated[: len(solo)] == solo and set(generated[len(solo) :]) <= {pad}
    assert drafter.speculation_stats.target_forwards > 0


def test_generate_with_a_batch_refuses_what_it_cannot_reproduce():
    target = make_target("llama", num_hidden_layers=2)
    drafter = make_drafter("mtp", target, oracle=False)
    batch = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        target.generate(batch, max_new_tokens=5, repetition_penalty=1.3, assistant_model=drafter)


def test_engine_with_a_corrupt_cost_profile_reprofiles_over_its_batch_sizes_with_a_warning(package_log):
    from angelspec_hf.generation import verify_cost

    target = make_target("llama", num_hidden_layers=2, dtype=torch.float32, seed=21)
    path = verify_cost.cost_model_path(target)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write("{corrupt")
    verify_cost._LOADED.clear()
    with package_log.warns("unreadable"):
        engine = SpeculativeEngine(target, make_drafter("mtp", target, oracle=False), max_batch_size=6)
    assert engine.session.policy.cost_model.profile.rows == [1, 2, 4, 6]
    assert verify_cost.VerifyCostModel.load(path).rows == [1, 2, 4, 6]


def test_numpy_integer_token_ids_and_settings_are_accepted():
    import numpy as np

    target = make_target("llama", num_hidden_layers=2)
    prompt = [5, 6, 7, 8]
    expected = solo_outputs(target, [Request(prompt, max_new_tokens=6, request_id=0)])[0]
    requests = [
        Request(np.array(prompt), max_new_tokens=np.int64(6)),
        Request([np.int32(t) for t in prompt], max_new_tokens=6, eos_token_id=np.int64(target.config.eos_token_id)),
        Request(np.array(prompt, dtype=np.int16), max_new_tokens=6, do_sample=True, seed=np.int64(3)),
    ]
    outputs = SpeculativeEngine(target, None, max_batch_size=3).generate(requests)
    assert [o.finish_reason for o in outputs] != ["error"] * 3 and all(o.error is None for o in outputs)
    assert outputs[0].output_ids == expected and outputs[1].output_ids == expected
    assert all(type(token) is int for o in outputs for token in o.output_ids + o.prompt_ids)
