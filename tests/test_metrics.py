"""The acceptance metric: one computation behind SpeculationStats, the `evaluate` metric, callback and benchmark."""

import pytest

from angelspec_hf.acceptance_metric import SpeculativeAcceptance
from angelspec_hf.metrics import SpeculationStats


def test_tau_and_acceptance_by_position_by_hand():
    # Rounds: all 3 accepted; 1 of 3; 0 of 2 -> 4 + 2 + 1 = 7 tokens in 3 forwards.
    result = SpeculativeAcceptance().compute(drafted=[3, 3, 2], accepted=[3, 1, 0])
    assert result["tau"] == pytest.approx(7 / 3) and result["tokens"] == 7 and result["target_forwards"] == 3
    # Position 1 tried 3 times, passed twice; position 2 tried twice (rounds 1, 2), passed once; position 3 once, passed.
    assert result["acceptance_by_depth"] == pytest.approx([2 / 3, 1 / 2, 1.0])


def test_incremental_adds_equal_one_compute_and_the_stats_object():
    metric = SpeculativeAcceptance()
    metric.add_batch(drafted=[4, 2], accepted=[2, 2])
    metric.add(drafted=1, accepted=0)
    stats = SpeculationStats([4, 2, 1], [2, 2, 0])
    assert metric.compute() == {
        "tau": stats.tau,
        "acceptance_by_depth": stats.acceptance_by_depth(),
        "target_forwards": 3,
        "tokens": 7,
    }


def test_impossible_rounds_are_refused():
    with pytest.raises(ValueError, match="accepted <= drafted"):
        SpeculativeAcceptance().compute(drafted=[2], accepted=[3])
