"""D-cut: the verified-depth policy, the confidence calibration and the profiled verify-cost model."""

import itertools
import json
import os

import pytest
import torch
from conftest import make_target

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter
from angelspec_hf.generation import policies, verify_cost
from angelspec_hf.generation.dcut import ConfidenceCalibrator, dcut_depths, observed_steps, prefix_confidence
from angelspec_hf.generation.verify_cost import VerifyCostModel


def rate(depths, confidences, cost, draft_seconds):
    expected = len(depths) + sum(float(c[:d].sum()) for c, d in zip(confidences, depths))
    return expected / (draft_seconds + cost(len(depths), 1 + max(depths)))


def test_one_request_gets_the_depth_with_the_best_expected_tokens_per_second():
    cost = VerifyCostModel(rows=[1], tokens=[1, 2, 4, 8, 16], seconds=[[0.060, 0.062, 0.070, 0.085, 0.110]], context=0)
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        probabilities = torch.rand(15, generator=generator) ** 0.3
        confidences = [prefix_confidence(probabilities)]
        draft_seconds = 0.01 * (trial % 3)
        best = max(range(16), key=lambda depth: (rate([depth], confidences, cost, draft_seconds), -depth))
        assert dcut_depths(confidences, cost, draft_seconds) == [best]


def test_batch_budget_follows_the_most_confident_requests():
    """Rows are padded to the widest, so the confident requests set the width and the doubtful ones fill it."""
    cost = VerifyCostModel(rows=[1, 4], tokens=[1, 16], seconds=[[0.06, 0.09], [0.08, 0.30]], context=0)
    confident = prefix_confidence(torch.full((12,), 0.95))
    doubtful = prefix_confidence(torch.full((4,), 0.3))
    confidences = [doubtful, confident, doubtful, confident]
    depths = dcut_depths(confidences, cost)
    assert depths[1] == depths[3] >= 4 and depths[0] == depths[2] == 4
    best = max(
        rate(list(d), confidences, cost, 0.0) for d in itertools.product(range(5), range(13), range(5), range(13))
    )
    assert rate(depths, confidences, cost, 0.0) >= 0.97 * best
    narrow = dcut_depths([doubtful, doubtful], cost)
    assert max(narrow) < 4, "doubtful drafts alone are not worth a wide verify forward"


def test_free_verification_verifies_everything_and_expensive_verification_nothing():
    confidences = [prefix_confidence(torch.full((6,), 0.5))]
    free = VerifyCostModel(rows=[1], tokens=[1, 8], seconds=[[0.05, 0.05]], context=0)
    costly = VerifyCostModel(rows=[1], tokens=[1, 2], seconds=[[0.05, 0.10]], context=0)
    assert dcut_depths(confidences, free) == [6]
    assert dcut_depths(confidences, costly) == [0]


def test_calibration_learns_each_steps_acceptance_and_multiplies_them():
    """Before any observation the calibration is the identity (the raw prefix product); an overconfident drafter
    whose later steps at 0.95 are accepted 30 % of the time gets those steps' rate, prefixes get the product of their
    steps' rates, never growing along the draft; the first step, calibrated apart, keeps its own."""
    calibrator = ConfidenceCalibrator()
    raw = torch.tensor([0.95, 0.9, 0.5, 0.45])
    assert torch.allclose(calibrator(raw), prefix_confidence(raw))
    for step in range(300):
        calibrator.update(torch.tensor([0.95]), torch.tensor([1]), torch.tensor([step % 10 < 3]))
    calibrated = calibrator(torch.tensor([0.95, 0.95, 0.95]))
    assert calibrated[0] == pytest.approx(0.95)  # first steps never observed: still the identity
    assert calibrated[1] == pytest.approx(0.95 * 0.3, abs=0.02) and calibrated[2] == pytest.approx(
        0.95 * 0.09, abs=0.02
    )
    assert torch.all(calibrator(raw)[1:] <= calibrator(raw)[:-1])
    table = calibrator.table()
    later = [row for row in table if row["step"] == "later"]
    assert len(table) == 20 and later[9]["weight"] > 50 and abs(later[9]["accepted_rate"] - 0.3) < 0.05
    assert table[9]["accepted_rate"] is None  # the first step's bin


def test_observed_steps_are_those_reached_with_an_accepted_prefix():
    """A verified row tells the acceptance of each step up to its first rejection, nothing of the steps after it."""
    assert observed_steps(4, 2) == (3, [True, True, False])
    assert observed_steps(3, 3) == (3, [True, True, True])
    assert observed_steps(0, 0) == (0, [])
    assert observed_steps(5, 0) == (1, [False])


def test_a_sampled_rows_confidence_reads_only_what_was_known_before_each_draw():
    """c_k = Π_{j<k} a(q_j(x_j)) · a(m_k): changing the drawn token's probability at step k changes the confidences
    after k, never c_k itself."""
    calibrator = ConfidenceCalibrator()
    for step in range(100):
        calibrator.update(
            torch.tensor([0.35, 0.75]), torch.tensor([0, 1]), torch.tensor([step % 2 == 0, step % 4 == 0])
        )
    known = torch.tensor([0.6, 0.5, 0.4])
    before = calibrator(torch.tensor([0.3, 0.7, 0.2]), known)
    after = calibrator(torch.tensor([0.3, 0.1, 0.9]), known)
    assert torch.equal(before[:2], after[:2]) and not torch.equal(before[2], after[2])


def test_calibration_keeps_one_map_per_source():
    """The router's members are calibrated apart: an overconfident member (its 0.9+ drafts accepted 30% of the time)
    does not lower the calibration of a well-calibrated one (accepted 90%), and a new source starts from the
    identity."""
    calibrator = ConfidenceCalibrator()
    for step in range(300):
        calibrator.update(
            torch.tensor([0.95, 0.95]),
            torch.tensor([0, 0]),
            torch.tensor([step % 10 < 3, step % 10 < 9]),
            sources=torch.tensor([0, 2]),
        )
    raw = torch.tensor([[0.95, 0.5], [0.95, 0.5], [0.95, 0.5]])
    calibrated = calibrator(raw, sources=torch.tensor([[0], [2], [1]]))
    assert abs(float(calibrated[0, 0]) - 0.3) < 0.05 and abs(float(calibrated[1, 0]) - 0.9) < 0.05
    assert torch.allclose(calibrated[2], prefix_confidence(raw[2]))  # source 1 never drafted: the identity
    assert abs(calibrator.table(2)[9]["accepted_rate"] - 0.9) < 0.05 and calibrator.table(1)[9]["weight"] == 0


def test_calibrated_confidences_are_the_product_of_the_step_rates():
    """`__call__` (plain floats, maps read once per update) equals its definition over `step_rate`'s tensors,
    c_k = cummin_k(Π_{j<k} a_j(q_j) · a_k(m_k)), after updates, for rows of several sources, new sources included."""
    generator = torch.Generator().manual_seed(11)
    calibrator = ConfidenceCalibrator()
    for round in range(6):
        for _ in range(40):
            raw = torch.rand(5, generator=generator, dtype=torch.float64)
            calibrator.update(
                raw,
                torch.randint(0, 3, (5,), generator=generator),
                torch.rand(5, generator=generator) < raw,
                sources=torch.randint(0, 2, (5,), generator=generator),
            )
        chosen = torch.rand(3, 4, generator=generator, dtype=torch.float64)
        known = torch.rand(3, 4, generator=generator, dtype=torch.float64)
        sources = torch.tensor([[0], [1], [round % 3]])
        chosen_rate, known_rate = calibrator.step_rate(chosen, sources), calibrator.step_rate(known, sources)
        before = torch.cat([torch.ones(3, 1, dtype=torch.float64), chosen_rate[:, :-1]], -1).cumprod(-1)
        expected = (before * known_rate).cummin(-1).values
        assert torch.allclose(calibrator(chosen, known, sources), expected, rtol=0, atol=1e-15)
        assert torch.allclose(calibrator(chosen[0]), calibrator(chosen[:1], chosen[:1])[0], rtol=0, atol=0)


def test_cost_model_interpolates_and_round_trips(tmp_path):
    model = VerifyCostModel(rows=[1, 4], tokens=[1, 4, 16], seconds=[[1.0, 1.3, 2.5], [2.0, 3.0, 8.0]], context=64)
    assert model(1, 1) == 1.0 and model(1, 2) == pytest.approx(1.1) and model(1, 28) == pytest.approx(3.7)
    assert model(2, 4) == pytest.approx(1.3 + (3.0 - 1.3) / 3)
    path = tmp_path / "profile.json"
    model.save(str(path))
    assert VerifyCostModel.load(str(path)) == model


def test_missing_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    target = make_target("qwen2", seed=9, dtype=torch.float32)
    path = str(tmp_path / "cost.json")
    model = verify_cost.load_cost_model(target, path)
    assert os.path.exists(path) and len(model.seconds[0]) == len(verify_cost.PROFILED_TOKENS)
    assert all(value > 0 for value in model.seconds[0]) and model.machine["threads"] == torch.get_num_threads()
    verify_cost._LOADED.clear()
    monkeypatch.setattr(
        verify_cost, "profile_verify_cost", lambda *a, **k: pytest.fail("a cached profile was re-measured")
    )
    assert verify_cost.load_cost_model(target, path) == model


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"rows": [1], "tokens": [1], "seconds": [[-1.0]], "context": 0})]
)
def test_unreadable_profile_falls_back_to_profiling_with_a_warning(tmp_path, content, package_log):
    target = make_target("llama", seed=10, dtype=torch.float32)
    path = tmp_path / "cost.json"
    path.write_text(content)
    with package_log.warns("unreadable"):
        model = verify_cost.load_cost_model(target, str(path))
    assert VerifyCostModel.load(str(path)) == model


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_sequential_drafting_stops_when_no_further_token_can_pay_for_its_verification(
    kind, monkeypatch, dcut_always_drafts
):
    """Each verified draft doubles a forward's cost here, so D-cut ends MTP's depths and DFly's AR head after the
    first token of every round; the output is still plain greedy decoding."""
    steep = VerifyCostModel(rows=[1], tokens=[1, 2], seconds=[[1.0, 2.0]], context=0)
    monkeypatch.setattr(policies, "load_cost_model", lambda target, rows=(1,): steep)
    target = make_target("llama", seed=12)
    if kind == "mtp":
        drafter = AngelSpecMTPDrafter.from_target(target, num_depths=4)
    else:
        drafter = DFlyDrafter.from_target(
            target, block_size=6, num_draft_layers=1, mask_token_id=5, num_target_layers_tapped=2
        )
    lengths, propose = [], drafter.propose

    def recording_propose(*args, **kwargs):
        draft_ids, draft_logits = propose(*args, **kwargs)
        lengths.append(draft_ids.shape[1])
        return draft_ids, draft_logits

    monkeypatch.setattr(drafter, "propose", recording_propose)
    prompt = torch.randint(0, 95, (1, 7), generator=torch.Generator().manual_seed(5))
    output = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    assert torch.equal(output, target.generate(prompt, max_new_tokens=20, do_sample=False))
    assert lengths and set(lengths) <= {0, 1}


def test_drafting_goes_on_exactly_when_the_forecast_steps_beat_the_best_cut():
    """Random rounds: `worth_drafting_further` says continue exactly when some number of further steps, each row's
    forecast at its last step's rate (c_k · ρ^i, ρ = c_k / c_k-1; ρ = 1 after one step or none), each step paid
    for, has a cut that beats the best cut of what is drafted. After a single step (ρ = 1 is then a bound, as
    confidences never grow) a stop also holds against any continuation falling from the last confidence."""
    from angelspec_hf.generation.dcut import worth_drafting_further

    generator = torch.Generator().manual_seed(3)
    stops = continues = 0
    for trial in range(400):
        rows, drafted, most = int(torch.randint(1, 4, ())), int(torch.randint(0, 4, ())), 5
        raw = torch.rand(rows, most, generator=generator, dtype=torch.float64).cumprod(-1)
        table = sorted(torch.rand(most + 1, generator=generator).tolist())
        cost = VerifyCostModel(
            rows=[1], tokens=list(range(1, most + 2)), seconds=[[0.5 + t for t in table]], context=0
        )
        verify = lambda r, w: cost(1, w) * r  # noqa: E731
        draft_seconds, step = (
            float(torch.rand((), generator=generator)) * 0.3,
            float(torch.rand((), generator=generator)) * 0.2,
        )
        confidences = [row[:drafted] for row in raw]
        last = torch.tensor([float(c[-1]) if drafted else 1.0 for c in confidences], dtype=torch.float64)
        ratio = torch.tensor([float(c[-1] / c[-2]) if drafted > 1 else 1.0 for c in confidences], dtype=torch.float64)
        current = max(rate([w] * rows, confidences, verify, draft_seconds) for w in range(drafted + 1))

        def best_cut(extension):  # the best width over drafted + extension, the extension's steps paid for
            full = [torch.cat([c, e]) for c, e in zip(confidences, extension)]
            seconds = draft_seconds + step * extension.shape[1]
            return max(rate([w] * rows, full, verify, seconds) for w in range(drafted + extension.shape[1] + 1))

        forecast = last[:, None] * ratio[:, None] ** torch.arange(1, most - drafted + 1, dtype=torch.float64)
        pays = any(best_cut(forecast[:, :more]) > current + 1e-12 for more in range(1, most - drafted + 1))
        going_on = worth_drafting_further(confidences, verify, most, draft_seconds, step, top_confidence=1.0)
        assert going_on == pays, trial
        continues += going_on
        stops += not going_on
        if not going_on and drafted <= 1:
            for _ in range(20):
                more = int(torch.randint(1, most - drafted + 1, ()))
                extension = last[:, None] * torch.rand(rows, more, generator=generator, dtype=torch.float64).cumprod(
                    -1
                )
                assert best_cut(extension) <= current + 1e-12, trial
    assert stops > 20 and continues > 20


def test_the_forecast_stops_a_falling_draft_that_the_bound_would_draft_on():
    """Two steps at falling rates (0.9, then 0.5 of it): the next steps are forecast at half the last one's
    confidence each, which cannot pay for a widening verify, while the bound (every step at 0.45) would."""
    from angelspec_hf.generation.dcut import worth_drafting_further

    def verify(rows, width):
        return 1.0 + 0.3 * width

    falling = [torch.tensor([0.9, 0.45], dtype=torch.float64)]
    steady = [torch.tensor([0.9, 0.9 * 0.9], dtype=torch.float64)]
    assert not worth_drafting_further(falling, verify, 8, 0.0, 0.0)
    assert worth_drafting_further(steady, verify, 8, 0.0, 0.0)
    assert worth_drafting_further([falling[0][:1]], verify, 8, 0.0, 0.0)  # after one step: at 0.9 a step pays


@pytest.mark.parametrize(
    "change",
    [
        {"rows": [0]},
        {"tokens": [0, 1]},
        {"tokens": [2, 1]},
        {"rows": []},
        {"seconds": [[1e9, 1e9]]},
        {"seconds": [[0.1, -1.0]]},
    ],
)
def test_invalid_profile_values_are_re_measured_with_a_warning(tmp_path, change, package_log):
    target = make_target("qwen2", seed=9, dtype=torch.float32)
    path = str(tmp_path / "cost.json")
    data = {"rows": [1], "tokens": [1, 2], "seconds": [[0.1, 0.2]], "context": 8, "machine": {}}
    data.update(change)
    with open(path, "w") as stream:
        json.dump(data, stream)
    with package_log.warns("not a valid verify-cost profile"):
        model = verify_cost.load_cost_model(target, path)
    assert model.problem() is None and model.rows == [1] and VerifyCostModel.load(path) == model


def test_an_unwritable_profile_cache_warns_and_goes_on(tmp_path, package_log):
    target = make_target("qwen2", seed=9, dtype=torch.float32)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with package_log.warns("Could not cache the verify-cost profile"):
        model = verify_cost.load_cost_model(target, str(blocker / "verify_cost" / "cost.json"))
    assert model.problem() is None and model(1, 2) > 0


def test_profiling_refuses_empty_or_zero_sizes_before_measuring():
    target = make_target("qwen2", seed=9, dtype=torch.float32)
    for rows, tokens, repeats in [([0], [1], 1), ([1], [0], 1), ([], [1], 1), ([1], [1], 0)]:
        with pytest.raises(ValueError, match="rows|tokens|repeats"):
            verify_cost.profile_verify_cost(target, rows=rows, tokens=tokens, repeats=repeats, progress=False)


def test_the_early_exit_weighs_no_steps_beyond_what_the_drafter_of_the_rows_can_take():
    """A router member drafts at most its own tokens per round, fewer than the router's round allows; D-cut's early
    exit must not keep it drafting for steps it can never take (a suffix member kept drafting a third more steps)."""
    from angelspec_hf.generation.dcut import ConfidenceCalibrator
    from angelspec_hf.generation.draft_round import DraftRound

    drafting = DraftRound(torch.ones(1), sampled=[False])
    for _ in range(2):
        drafting(torch.tensor([[0.0, 4.0, 0.0]]))  # confident steps
    calibrator = ConfidenceCalibrator()

    def widening_costs_little(rows, width):
        return 1.0 + 0.01 * width

    assert drafting.worth_continuing(calibrator, widening_costs_little, 15, 0.001)
    drafting.max_steps = 2  # the member's cap, reached
    assert not drafting.worth_continuing(calibrator, widening_costs_little, 15, 0.001)
    drafting.max_steps = 3
    assert drafting.worth_continuing(calibrator, widening_costs_little, 15, 0.001)
    share = drafting.rows([0])
    share.max_steps = 0
    assert not share.worth_continuing(calibrator, widening_costs_little, 15, 0.001)


def test_timings_on_cuda_wait_for_the_device(monkeypatch):
    """CUDA kernels run asynchronously: the verify-cost profile and the benchmark read the clock after a sync."""
    from angelspec_hf.generation.timing import device_clock

    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(str(device)))
    device_clock("cpu")
    assert synchronized == []
    device_clock("cuda:0")
    assert synchronized == ["cuda:0"]


def test_a_noisy_non_monotone_profile_is_fitted_to_never_decrease(monkeypatch):
    """A verify forward of more tokens, or of more rows, never costs less: medians that say otherwise (a burst of
    load, a kernel switch) are replaced by their least-squares non-decreasing fit, and kept beside it."""
    import time

    fitted = verify_cost.monotone_fit([[0.0546, 0.0508, 0.07, 0.104, 0.088], [0.05, 0.06, 0.05, 0.2, 0.1]])
    assert fitted == [
        pytest.approx([0.0527, 0.0527, 0.07, 0.096, 0.096]),
        pytest.approx([0.0527, 0.055, 0.07, 0.15, 0.15]),
    ]
    target = make_target("qwen2", seed=9, dtype=torch.float32)
    delays = {1: 0.012, 2: 0.002, 3: 0.02, 4: 0.006}  # seconds added to a forward of that many new tokens
    forward = target.forward

    def uneven(*args, input_ids=None, **kwargs):
        time.sleep(delays.get(input_ids.shape[1], 0.0))
        return forward(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(target, "forward", uneven)
    model = verify_cost.profile_verify_cost(target, rows=[1, 2], tokens=[1, 2, 3, 4], repeats=2, progress=False)
    assert model.measured[0][1] < model.measured[0][0] and model.measured[0][3] < model.measured[0][2]
    for line in model.seconds:
        assert all(a <= b for a, b in zip(line, line[1:])), line
    assert all(a <= b for a, b in zip(*model.seconds))
    assert model.problem() is None


def test_the_verify_cost_is_profiled_on_the_cache_it_is_given():
    """`new_cache`: the engine's bound is timed on the cache the engine writes into (`growing_cache`, in place),
    not on transformers' `DynamicCache`, which copies itself at every forward."""
    from angelspec_hf.cache_utils import GrowingLayer, growing_cache

    made = []

    def new_cache():
        made.append(growing_cache())
        return made[-1]

    target = make_target("llama", dtype=torch.float32)
    model = verify_cost.profile_verify_cost(
        target, rows=[1, 2], tokens=[1, 2], repeats=1, progress=False, new_cache=new_cache
    )
    assert len(made) == 2 and all(isinstance(layer, GrowingLayer) for cache in made for layer in cache.layers)
    assert all(cache.get_seq_length() > 0 for cache in made) and model.problem() is None


def test_the_cost_in_use_follows_the_verify_forwards_a_run_times_and_never_falls_with_the_width():
    from angelspec_hf.generation.verify_cost import CorrectedCost

    profile = VerifyCostModel(rows=[1, 4], tokens=[1, 4, 16], seconds=[[1.0, 1.3, 2.5], [2.0, 3.0, 8.0]], context=64)
    cost = CorrectedCost(profile)
    assert [cost(4, w) for w in (1, 6, 16)] == [profile(4, w) for w in (1, 6, 16)]  # nothing measured: the profile
    cost.observe(4, 6, 2 * profile(4, 6))
    assert cost(4, 6) == pytest.approx(2 * profile(4, 6))
    assert cost(4, 9) == pytest.approx(2 * profile(4, 9)) and cost(8, 6) == pytest.approx(2 * profile(8, 6))
    cost.observe(4, 1, profile(4, 1))  # width 1 as profiled: the widths nearer 1 read its ratio
    assert cost(4, 1) == pytest.approx(profile(4, 1)) and cost(4, 3) == pytest.approx(profile(4, 3))
    widths = [cost(4, w) for w in range(1, 17)]
    assert widths == sorted(widths) and cost(4, 7) >= cost(4, 6)
    cost.observe(4, 6, 1.5 * profile(4, 6))  # a running average: one forward moves it by a tenth
    assert cost.ratio(4, 6) == pytest.approx(0.9 * 2 + 0.1 * 1.5)
    cost.observe(4, 1, 100 * profile(4, 1))  # a stall moves it at most to the bound
    assert cost.ratio(4, 1) == pytest.approx(0.9 * 1 + 0.1 * 2)
    for bad in (float("nan"), 0.0, -1.0):
        cost.observe(4, 1, bad)
    assert cost.ratio(4, 1) == pytest.approx(1.1)


def test_dcut_verifies_less_once_the_run_finds_wide_forwards_slower_than_profiled():
    """The profile says a wide verify costs little more than a narrow one; the run's forwards say it costs double:
    the session's cost model learns it and the cut verifies fewer of the same doubtful drafts."""
    from angelspec_hf.generation.session import DecodingSession

    target = make_target("llama", num_hidden_layers=2)
    drafter = AngelSpecMTPDrafter.from_target(target, num_depths=4)
    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 8], seconds=[[1.0, 1.05, 1.4]], context=0)
    session = DecodingSession(target, drafter, "dcut", cost_model=profile)
    confidences = [prefix_confidence(torch.full((4,), 0.7))]
    session.policy.draft_count([session.new_row()], budget=100, backlog=1)
    before = dcut_depths(confidences, session.policy.verify_seconds)
    for width in range(1, 6):
        for _ in range(20):
            session.observe_forward(1, width, profile(1, width) * (1 + 0.25 * (width - 1)))
    session.policy.draft_count([session.new_row()], budget=100, backlog=1)
    after = dcut_depths(confidences, session.policy.verify_seconds)
    assert before == [4] and after == [2]


def test_a_drafter_s_shipped_offline_acceptance_prices_its_first_rounds():
    """`dcut_prior_acceptance` in the drafter's generation config (`angelspec estimate --write-prior`) is D-cut's
    ĉ_k before any drafting: with it, a fresh session expects drafting to pay where the same drafter without it
    could only be probed (no ĉ yet), and where it is too low to pay, drafting is not expected to. A list that is not
    P(first k accepted) is refused with the field's name."""
    from angelspec_hf.generation.session import DecodingSession

    target = make_target("llama", num_hidden_layers=2)
    profile = VerifyCostModel(rows=[1], tokens=[1, 2, 4], seconds=[[1.0, 1.05, 1.2]], context=0)

    def pays(prior):
        drafter = AngelSpecMTPDrafter.from_target(target, num_depths=3)
        if prior is not None:
            drafter.generation_config.dcut_prior_acceptance = prior
        session = DecodingSession(target, drafter, "dcut", cost_model=profile)
        policy = session.policy
        policy.draft_count([session.new_row()], budget=100, backlog=1)
        return policy.depth_confidence, policy.drafting_pays(100, 1)

    assert pays(None) == (None, False)
    confidence, expected = pays([0.6, 0.4])
    assert confidence.tolist() == pytest.approx([0.6, 0.4, 0.4]) and expected
    assert not pays([0.02, 0.01])[1]
    for bad in ([0.3, 0.5], [1.5], [], "0.5"):
        with pytest.raises(ValueError, match="dcut_prior_acceptance"):
            pays(bad)


def test_the_prior_written_by_estimate_is_the_steps_of_the_offline_tau():
    from angelspec_hf.cli.estimate import prefix_acceptance

    metrics = {"tau_depth_1": 1.42, "tau_depth_2": 1.62, "tau_depth_3": 1.61, "tau_depth_4": 1.65}
    assert prefix_acceptance(metrics, 4) == pytest.approx([0.42, 0.20, 0.0, 0.0])
