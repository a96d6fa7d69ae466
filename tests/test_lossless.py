"""Lossless under every verify schedule and every fault: sampled output keeps the target's law (χ²), a broken
drafter never changes or stops the target's output, and one bad request never costs the others their results."""

import random

import pytest
import torch
from conftest import make_target, rotate_router_members, take_transformers_loop
from oracles import FixedLawDFly, FixedLawMTP
from scipy.stats import chisquare

from angelspec_hf import AngelSpecMTPDrafter, DFlyDrafter, RouterDrafter, SuffixDrafter
from angelspec_hf.generation import dcut, draft_round, policies
from angelspec_hf.generation.dcut import ConfidenceCalibrator, dcut_depths
from angelspec_hf.generation.engine import Request, SpeculativeEngine
from angelspec_hf.generation.verify_cost import VerifyCostModel


# The shape of a 2-core machine's verify profile of SmolLM2 (one row: 34 ms for 1 token ... 84 ms for 32), the
# 4-row line scaled from it. A verified token costs little next to the forward itself, so D-cut's cut depends on
# confidence.
REAL_PROFILE = VerifyCostModel(
    rows=[1, 4],
    tokens=[1, 2, 3, 4, 8, 16, 32],
    seconds=[[0.034, 0.039, 0.040, 0.051, 0.061, 0.068, 0.084], [0.054, 0.062, 0.064, 0.082, 0.098, 0.109, 0.134]],
    context=128,
)
# A verify cost under which a drafted token pays only when quite likely accepted: D-cut's cut then turns on the
# drafted probabilities, which is where a cut reading the token it judges would bias the sampled law.
# For 4 rows a wider forward costs less per row: one row's likely draft pays for it, and then the others ride along.
STEEP_PROFILE = VerifyCostModel(
    rows=[1, 4], tokens=[1, 2, 3, 4], seconds=[[1.0, 1.5, 1.8, 2.1], [1.0, 1.1, 1.2, 1.3]], context=0
)
VOCAB, PROMPT = 5, [1, 2, 3]
# D-cut's cases, where a cut reading the drafted token would bias the law subtly, draw 2,500 continuations: the old
# cut failed them at p = 6e-43 with 5,000, and χ²'s excess over its degrees of freedom grows linearly with the count,
# so a bias that large is missed at 2,500 with probability below 1e-5 (noncentral χ², 40-100 cells). The constant and
# heuristic schedules (plain rejection sampling, where a fault shows at once) draw 1,500.
SAMPLES = {"dcut": 2500, "constant": 1500, "heuristic": 1500}
SCHEDULES = ["dcut", "constant", "heuristic"]
# generate(): one sequence on the engine, or on transformers' loop (where a call has a streamer, scores or another
# logits processor); the engine itself with 4 rows
PATHS = ["generate", "transformers-loop", "engine-4"]
KINDS = ["mtp", "dfly", "suffix", "router"]
# Every schedule on every path, and every drafter kind on every path under D-cut (the schedule that reads the drafts'
# confidences, where a fault would be subtle); the fixed schedules (plain rejection sampling of whatever was drafted,
# the same policy code whoever drafts) through the router, whose members take turns (`rotate_router_members`), so that
# every kind meets every schedule on every path.
FIXED_SCHEDULE_KINDS = {"constant": ["router"], "heuristic": ["router"]}
CASES = [(kind, "dcut", path) for kind in KINDS for path in PATHS] + [
    (kind, schedule, path) for schedule, kinds in FIXED_SCHEDULE_KINDS.items() for kind in kinds for path in PATHS
]


def tiny_target(seed=11):
    """One layer: the law under test is whatever the target's is, and each sample costs a few target forwards."""
    target = make_target(
        "llama", vocab_size=VOCAB, seed=seed, eos_token_id=None, pad_token_id=None, num_hidden_layers=1
    )
    target.lm_head.weight.div_(4.0)  # moderately peaked: many cells have mass
    return target


def random_drafter(kind, target, scale, seed, fixed_law=False):
    """A drafter with N(0, scale²) weights: at scale 5 confidently wrong (adversarial), at 1 peaked but milder;
    `fixed_law` drafts from `FixedLawDrafting.law` instead of its own head."""
    if kind == "router":  # each member in turn, per request (see `rotate_router_members`)
        members = [
            random_drafter(member, target, scale, seed + i) for i, member in enumerate(["mtp", "dfly", "suffix"])
        ]
        return RouterDrafter.from_members(members)
    if kind == "suffix":  # no weights: its law comes from matches against a random shared index of outputs
        drafter = SuffixDrafter.from_target(target, num_draft_tokens=3, min_match_length=1)
        text = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(seed))
        for part in text.split(40):
            drafter.record_output(part.tolist())
        return drafter
    if kind == "mtp":
        drafter = (FixedLawMTP if fixed_law else AngelSpecMTPDrafter).from_target(
            target, num_depths=3, draft_vocab_size=4
        )
    else:  # the AR head samples each block position after the token sampled before it
        drafter = (FixedLawDFly if fixed_law else DFlyDrafter).from_target(
            target, block_size=4, num_draft_layers=1, mask_token_id=0, num_target_layers_tapped=1, draft_vocab_size=4
        )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    return drafter


def exact_law(target, steps=3):
    """P(x1, ..., x_steps) of the target after PROMPT, as a flat tensor over VOCAB**steps cells."""
    law = torch.ones(1, dtype=torch.float64)
    prefixes = [[]]
    for _ in range(steps):
        rows = torch.stack([target(torch.tensor([PROMPT + p])).logits[0, -1].double().softmax(-1) for p in prefixes])
        law = (law[:, None] * rows).flatten()
        prefixes = [p + [x] for p in prefixes for x in range(VOCAB)]
    return law


def assert_target_law(counts, law):
    """χ² of sampled cell counts against the exact law (cells expected below 5 pooled into one)."""
    expected = law * counts.sum()
    keep = expected >= 5
    observed, expected = counts[keep], expected[keep]
    if not keep.all():
        observed = torch.cat([observed, counts[~keep].sum()[None]])
        expected = torch.cat([expected, (law * counts.sum())[~keep].sum()[None]])
    pvalue = chisquare(observed.numpy(), expected.numpy()).pvalue
    assert pvalue > 1e-3, f"sampled law differs from the target's: χ² p = {pvalue:.2g}"


def frozen_calibration(monkeypatch):
    """Keep D-cut's confidences raw, so its cut keeps depending on the drafted probabilities (the adversarial case:
    a calibrator that learns a confidently wrong drafter away would stop drafting and test nothing)."""
    monkeypatch.setattr(ConfidenceCalibrator, "update", lambda self, raw, steps, accepted, sources=None: None)


def sample_first_tokens(path, schedule, target, drafter, seed, profile, samples, monkeypatch):
    """Cell index of the first three sampled tokens of `samples` continuations, and how many drafts were verified."""
    cells, verified = [], 0
    if path == "transformers-loop":
        take_transformers_loop(monkeypatch)
    if path in ("generate", "transformers-loop"):
        drafter.generation_config.num_assistant_tokens_schedule = schedule
        torch.manual_seed(seed)
        for _ in range(samples):
            output = target.generate(
                torch.tensor([PROMPT]),
                max_new_tokens=3,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                assistant_model=drafter,
            )
            cells.append(output[0, len(PROMPT) :].tolist())
            verified += sum(drafter.speculation_stats.drafted)
    else:
        # Every request after the first starts from the prompt's kept prefill (`PromptPrefills`), so that path meets
        # the χ² test too (generate() prefills each).
        engine = SpeculativeEngine(
            target, drafter, policy=schedule, max_batch_size=4, cost_model=profile, prompt_cache_tokens=len(PROMPT)
        )
        requests = [
            Request(PROMPT, max_new_tokens=3, eos_token_id=[], do_sample=True, seed=seed * 10_000 + s)
            for s in range(samples)
        ]
        outputs = engine.generate(requests)
        cells = [o.output_ids for o in outputs]
        verified = sum(sum(o.stats.drafted) for o in outputs)
    index = torch.tensor([(a * VOCAB + b) * VOCAB + c for a, b, c in cells])
    return torch.bincount(index, minlength=VOCAB**3).double(), verified


def check_sampled_law(kind, schedule, path, drafting, profile, case, monkeypatch, pin_drafting=True):
    """With `pin_drafting`, D-cut drafts every round (as `dcut_always_drafts`: runs of 3 tokens would rarely let it);
    without, its own draft-or-skip pricing and exploration decide, over a long engine run."""
    monkeypatch.setattr(policies, "load_cost_model", lambda target, rows=(1,): profile)
    frozen_calibration(monkeypatch)
    if pin_drafting:
        monkeypatch.setattr(policies.DCut, "drafting_pays", lambda self, budget, backlog: True)
    target = tiny_target(seed=11 + case % 3)
    scale = 5.0 if drafting == "adversarial" else {"mtp": 1.0, "dfly": 0.5, "suffix": 0.0, "router": 0.5}[kind]
    if kind == "router":
        rotate_router_members(monkeypatch)
    drafter = random_drafter(kind, target, scale=scale, seed=case, fixed_law=drafting == "fixed-law")
    samples = SAMPLES[schedule]
    counts, verified = sample_first_tokens(
        path, schedule, target, drafter, seed=case, profile=profile, samples=samples, monkeypatch=monkeypatch
    )
    assert verified > samples // 4, "drafts must have gone through rejection sampling"
    assert_target_law(counts, exact_law(target))


@pytest.mark.chi2
@pytest.mark.parametrize("kind, schedule, path", CASES)
def test_sampling_keeps_the_target_law_under_every_schedule_and_path(kind, schedule, path, monkeypatch):
    """1,500-2,500 sampled continuations per case (`CASES`), target, drafter weights and seed changing from case to
    case. D-cut drafts from a fixed law under a steep verify cost, where a cut reading the token it judges would bias
    the output (`FixedLawDrafting`); the other schedules alternate a peaked random drafter with an adversarial one
    (N(0, 5²) weights: confidently wrong, so rejection sampling does most of the work). The suffix drafter drafts from
    its matches, its shared index growing with every sampled output; the router, each of those members in turn."""
    case = 6 * KINDS.index(kind) + 3 * SCHEDULES.index(schedule) + PATHS.index(path)
    drafting = "fixed-law" if schedule == "dcut" else ("adversarial" if case % 2 else "peaked")
    # The suffix drafter's confidences (matches in a random text) rarely clear the steep profile's bar; under this
    # machine's profile its cut still turns on them.
    profile = REAL_PROFILE if kind in ("suffix", "router") else STEEP_PROFILE
    check_sampled_law(kind, schedule, path, drafting, profile, case, monkeypatch)


@pytest.mark.chi2
@pytest.mark.parametrize("path", ["generate", "engine-4"])
def test_dcut_probes_verifying_a_first_draft_their_cut_drops_keep_the_target_law(path, monkeypatch):
    """Every round a probe (D-cut expects no round to pay and explores each), with a confidently wrong drafter under
    the steep profile, where the cut alone verifies little: the first draft a probe verifies whatever its confidence
    goes through rejection sampling like any other."""
    monkeypatch.setattr(policies.DCut, "drafting_pays", lambda self, budget, backlog: False)
    monkeypatch.setattr(policies.DCut, "may_explore", lambda self, count, budget, backlog: True)
    check_sampled_law("mtp", "dcut", path, "adversarial", STEEP_PROFILE, 21, monkeypatch, pin_drafting=False)


# A verify forward of 100 s: every drafted token pays, whatever the drafting takes on a loaded machine.
FLAT_PROFILE = VerifyCostModel(rows=[1, 64], tokens=[1, 32], seconds=[[100.0, 100.1], [100.0, 100.1]], context=128)


@pytest.mark.chi2
@pytest.mark.parametrize("kind, schedule, least_accepted", [("mtp", "dcut", 100), ("suffix", "constant-3", 20)])
def test_reproducible_sampling_keeps_the_target_law_and_depends_on_the_seed_alone(
    kind, schedule, least_accepted, monkeypatch
):
    """Reproducible requests (`Request.reproducible`): each token drawn from (seed, position). Their law is the
    target's at 4 rows, and the same seeds give the same texts with no drafter, one at a time."""
    monkeypatch.setattr(policies, "load_cost_model", lambda target, rows=(1,): FLAT_PROFILE)
    monkeypatch.setattr(policies.DCut, "drafting_pays", lambda self, budget, backlog: True)
    target = tiny_target(seed=13)
    drafter = random_drafter(kind, target, scale=1.0 if kind == "mtp" else 0.0, seed=31)
    requests = [
        Request(PROMPT, max_new_tokens=3, eos_token_id=[], do_sample=True, seed=s, reproducible=True)
        for s in range(1200)
    ]
    outputs = SpeculativeEngine(target, drafter, policy=schedule, max_batch_size=4).generate(requests)
    assert sum(sum(o.stats.accepted) for o in outputs) > least_accepted, "drafts must have been accepted"
    index = torch.tensor([(a * VOCAB + b) * VOCAB + c for a, b, c in (o.output_ids for o in outputs)])
    assert_target_law(torch.bincount(index, minlength=VOCAB**3).double(), exact_law(target))
    alone = SpeculativeEngine(target, None, max_batch_size=1).generate(requests[:200])
    assert [o.output_ids for o in alone] == [o.output_ids for o in outputs[:200]]


@pytest.mark.chi2
def test_dcut_sampling_with_an_adversarial_drafter_and_this_machines_profile(monkeypatch):
    """D-cut's own pricing decides which rounds draft (exploring the unknown drafter first), not a pin."""
    check_sampled_law(
        "dfly", "dcut", "engine-4", "adversarial", REAL_PROFILE, case=20, monkeypatch=monkeypatch, pin_drafting=False
    )


def test_dcut_never_lets_a_sampled_token_decide_its_own_verification():
    """Position k of a sampled row is verified or not from the confidences up to k alone: changing the ones after
    k (they depend on x_k) never changes whether k is verified. A greedy row's cut uses the whole draft."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        rows = int(torch.randint(1, 4, (), generator=generator))
        confidences = [
            torch.rand(6, generator=generator, dtype=torch.float64).sort(descending=True).values for _ in range(rows)
        ]
        depths = dcut_depths(confidences, REAL_PROFILE, sampled=[True] * rows)
        for r in range(rows):
            k = int(torch.randint(0, 6, (), generator=generator))
            changed = [c.clone() for c in confidences]
            changed[r][k + 1 :] = (
                torch.rand(5 - k, generator=generator, dtype=torch.float64).sort(descending=True).values
                * changed[r][k]
            )
            again = dcut_depths(changed, REAL_PROFILE, sampled=[True] * rows)
            assert (depths[r] > k) == (again[r] > k)
    greedy = [torch.tensor([0.9, 0.05, 0.05, 0.05], dtype=torch.float64)]
    assert dcut_depths(greedy, REAL_PROFILE) == dcut_depths(greedy, REAL_PROFILE, sampled=[False])


@pytest.mark.parametrize("garbage", ["nan", "inf", "zero", "huge"])
@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_a_garbage_drafter_never_changes_or_stops_the_targets_output(kind, garbage):
    """NaN / inf / zero / huge drafter weights: greedy output equals plain decoding and sampling runs (non-finite
    draft scores mean no draft), in generate() and the engine, with every schedule."""
    target = make_target("llama", seed=3)
    drafter = random_drafter(kind, target, scale=1.0, seed=0)
    value = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0, "huge": 1e30}[garbage]
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:
                parameter.fill_(value)
    prompt = torch.tensor([[5, 17, 42, 8]])
    reference = target.generate(prompt, max_new_tokens=12, do_sample=False)
    for schedule in SCHEDULES:
        drafter.generation_config.num_assistant_tokens_schedule = schedule
        greedy = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter)
        assert torch.equal(greedy, reference), schedule
        sampled = target.generate(prompt, max_new_tokens=12, do_sample=True, assistant_model=drafter)
        assert prompt.shape[1] < sampled.shape[1] <= reference.shape[1]  # it may sample EOS early
    for policy in ["dcut", "constant-3", "heuristic"]:
        engine = SpeculativeEngine(target, drafter, policy=policy, max_batch_size=2, cost_model=REAL_PROFILE)
        outputs = engine.generate(
            [
                Request(prompt[0].tolist(), max_new_tokens=12, eos_token_id=[]),
                Request(prompt[0].tolist(), max_new_tokens=12, eos_token_id=[], do_sample=True, seed=1),
            ]
        )
        assert outputs[0].output_ids == reference[0, 4:].tolist(), policy
        assert outputs[1].error is None and len(outputs[1].output_ids) == 12


def test_non_finite_draft_scores_warn_once_and_are_never_verified(package_log):
    from transformers.utils.logging import warning_once

    drafting = draft_round.DraftRound(torch.ones(3), sampled=[False, True, False])
    warning_once.cache_clear()  # transformers' once-per-process memory
    with package_log.warns("non-finite"):
        drafting.choose(torch.tensor([[1.0, 2.0, 0.5], [float("nan"), 0.0, 1.0], [1.0, 0.0, 0.0]]))
    with package_log.silent():
        drafting.choose(torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 1.0], [float("inf"), 0.0, 0.0]]))  # once only
    assert drafting.usable_steps() == [2, 0, 1]  # once broken, a row's later steps are not verified either
    assert torch.equal(drafting.confidence(ConfidenceCalibrator())[1], torch.zeros(2, dtype=torch.float64))


# -- the engine: one bad request never costs the others ------------------------------------------------------------


def test_the_same_request_object_twice_is_served_twice():
    target = make_target("llama", seed=1)
    request = Request([4, 8, 15], max_new_tokens=10, eos_token_id=[])
    reference = target.generate(torch.tensor([request.input_ids]), max_new_tokens=10, do_sample=False)[0, 3:].tolist()
    sampled = Request([4, 8, 15], max_new_tokens=6, eos_token_id=[], do_sample=True, seed=7)
    engine = SpeculativeEngine(
        target, random_drafter("mtp", target, scale=1.0, seed=0), max_batch_size=4, cost_model=REAL_PROFILE
    )
    outputs = engine.generate([request] * 3 + [sampled, sampled])
    assert [o.output_ids for o in outputs[:3]] == [reference] * 3
    assert [len(o.output_ids) for o in outputs[3:]] == [6, 6] and outputs[3] is not outputs[4]
    assert request.request_id is None and request.input_ids == [4, 8, 15]  # the caller's object is not modified


@pytest.mark.parametrize(
    "bad, reason",
    [
        (Request([1, 2, 500], max_new_tokens=4), "not an integer in the vocabulary"),
        (Request([1, -2], max_new_tokens=4), "not an integer in the vocabulary"),
        (Request([1, 2.5], max_new_tokens=4), "not an integer in the vocabulary"),
        (Request([], max_new_tokens=4), "empty prompt"),
        (Request([1, 2], max_new_tokens=0), "max_new_tokens"),
        (Request([1, 2], do_sample=True, temperature=0.0), "temperature"),
        (Request([1, 2], do_sample=True, temperature=float("nan")), "temperature"),
        (Request([1, 2], do_sample=True, top_k=-1), "top_k"),
        (Request([1, 2], do_sample=True, top_p=1.5), "top_p"),
        (Request([1, 2], eos_token_id="end"), "eos_token_id"),
        (Request(torch.zeros(2, 3, dtype=torch.long)), "single row"),
        (Request(torch.tensor([1.0, 2.0])), "integers"),
    ],
)
def test_a_bad_request_is_rejected_at_submission_and_the_others_are_served(bad, reason, package_log):
    target = make_target("llama", seed=1)
    good = [
        Request([3, 1, 4], max_new_tokens=5, eos_token_id=[]),
        Request(torch.tensor([[2, 7, 1]]), max_new_tokens=5, eos_token_id=[]),
    ]
    engine = SpeculativeEngine(target, None, max_batch_size=2)
    with package_log.warns("rejected"):
        outputs = engine.generate([good[0], bad, good[1]])
    assert outputs[1].finish_reason == "error" and reason in outputs[1].error
    for request, output in zip(good, [outputs[0], outputs[2]]):
        ids = torch.as_tensor(request.input_ids).view(1, -1)
        assert output.output_ids == target.generate(ids, max_new_tokens=5, do_sample=False)[0, 3:].tolist()


def test_a_request_failing_mid_run_finishes_with_its_error_while_the_others_are_served(monkeypatch, package_log):
    target = make_target("llama", seed=1)
    requests = [
        Request([3, 1, 4 + i], max_new_tokens=8, eos_token_id=[], do_sample=i == 1, seed=i, request_id=i)
        for i in range(3)
    ]
    engine = SpeculativeEngine(
        target, random_drafter("mtp", target, scale=1.0, seed=0), policy="constant-2", max_batch_size=3
    )
    original = engine._probabilities
    calls = {"count": 0}

    def failing(row, logits):  # the sampled request breaks at its third round
        calls["count"] += 1
        if calls["count"] == 3:
            raise RuntimeError("sampler exploded")
        return original(row, logits)

    monkeypatch.setattr(engine, "_probabilities", failing)
    with package_log.warns("sampler exploded"):
        outputs = engine.generate(requests)
    assert outputs[1].finish_reason == "error" and "sampler exploded" in outputs[1].error
    for i in (0, 2):
        ids = torch.tensor([requests[i].input_ids])
        assert outputs[i].output_ids == target.generate(ids, max_new_tokens=8, do_sample=False)[0, 3:].tolist()


def test_a_request_that_exactly_fills_the_context_is_served_as_plain_generate_serves_it(package_log):
    target = make_target("llama", seed=2, max_position_embeddings=32)
    prompt = list(range(1, 21))
    reference = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 20:].tolist()
    for drafter in (None, random_drafter("dfly", target, scale=1.0, seed=0)):
        outputs = SpeculativeEngine(target, drafter, policy="constant-3").generate(
            [Request(prompt, max_new_tokens=12, eos_token_id=[])]
        )
        assert outputs[0].error is None and outputs[0].output_ids == reference
    with package_log.warns("context"):
        outputs = SpeculativeEngine(target, None).generate([Request(prompt, max_new_tokens=13)])
    assert outputs[0].finish_reason == "error"


def test_engine_settings_are_checked():
    target = make_target("llama", seed=2)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        SpeculativeEngine(target, None, memory_budget_bytes=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        SpeculativeEngine(target, None, max_batch_size=0)


def test_soak_a_thousand_mixed_requests_arriving_at_random():
    """1,000+ requests, some bad, submitted at random moments between engine steps: every good greedy request gets
    exactly its solo output, every sampled one its length, every bad one an error; none lost or duplicated."""
    target = make_target("qwen2", seed=5, num_hidden_layers=1)
    vocab = target.config.vocab_size
    rng = random.Random(0)
    pool = [
        ([rng.randrange(vocab - 1) for _ in range(rng.choice([1, 2, 5, 9]))], rng.choice([1, 2, 4, 7]))
        for _ in range(24)
    ]
    references = {
        (tuple(p), n): target.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None)[
            0, len(p) :
        ].tolist()
        for p, n in pool
    }
    bad_requests = [
        Request([vocab + 3], max_new_tokens=2),
        Request([], max_new_tokens=2),
        Request([1], do_sample=True, top_k=-1),
    ]
    engine = SpeculativeEngine(
        target, random_drafter("mtp", target, scale=1.0, seed=2), max_batch_size=8, cost_model=REAL_PROFILE
    )
    submitted, steps = [], 0
    while len(submitted) < 1200 or engine.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 3, 9]) if len(submitted) < 1200 else 0):
            kind = rng.random()
            if kind < 0.05:
                request = rng.choice(bad_requests)
            else:
                prompt, limit = rng.choice(pool)
                request = Request(
                    prompt, max_new_tokens=limit, eos_token_id=[], do_sample=kind > 0.8, seed=rng.randrange(99)
                )
            submitted.append((request, engine.submit(request)))
        engine.step()
        steps += 1
        assert steps < 20000, "the engine stopped making progress"
    assert len({id(output) for _, output in submitted}) == len(submitted)
    for request, output in submitted:
        if request in bad_requests:
            assert output.finish_reason == "error" and not output.output_ids
        elif request.do_sample:
            assert output.finish_reason == "length" and len(output.output_ids) == request.max_new_tokens
        else:
            assert output.output_ids == references[(tuple(request.input_ids), request.max_new_tokens)]


def test_greedy_confidence_is_the_prefix_product_of_section_4():
    """A greedy row's token is the argmax, so E[q] is replaced by max q = q(x): before any calibration (the
    identity), a greedy row's confidence is §4's prefix product of its draft probabilities."""
    logits = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(0)) * 3
    drafting = draft_round.DraftRound(torch.ones(3), sampled=[False] * 3)
    for step in range(4):
        drafting.choose(logits[:, step])
    chosen = logits.softmax(-1).max(-1).values
    assert torch.allclose(drafting.confidence(ConfidenceCalibrator()), dcut.prefix_confidence(chosen))


def test_sampling_with_stop_strings_decodes_without_drafts(smollm2_tokenizer, package_log):
    """The stop-string cut reads the drafted token, which sampling cannot allow: such calls draft nothing."""
    target = make_target("llama", vocab_size=len(smollm2_tokenizer), seed=8, eos_token_id=None, pad_token_id=None)
    drafter = AngelSpecMTPDrafter.from_target(target, smollm2_tokenizer, num_depths=3, draft_vocab_size=512)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"  # without stop strings, every round drafts
    prompt = torch.tensor([smollm2_tokenizer("The quick brown fox")["input_ids"]])
    with package_log.warns("stop_strings"):
        target.generate(
            prompt,
            max_new_tokens=8,
            do_sample=True,
            stop_strings=["zzz"],
            tokenizer=smollm2_tokenizer,
            assistant_model=drafter,
        )
    assert sum(drafter.speculation_stats.drafted) == 0
    target.generate(prompt, max_new_tokens=8, do_sample=True, tokenizer=smollm2_tokenizer, assistant_model=drafter)
    assert sum(drafter.speculation_stats.drafted) > 0
