"""`SpeculativeAcceptance`: τ and acceptance by depth (`metrics.SpeculationStats`) as an `evaluate` metric, one
example per round, for code that collects predictions the `evaluate` way (the Trainer's callback, the benchmark).

Kept apart from `metrics`: importing `evaluate` takes seconds (it imports transformers' pipelines and `datasets`),
which the generation code need not pay.
"""

from __future__ import annotations

import datasets
import evaluate

from .metrics import SpeculationStats


class SpeculativeAcceptance(evaluate.Metric):
    """`evaluate` metric of speculative decoding: each example is one round, `drafted` tokens verified of which
    the first `accepted` were accepted. Returns τ, acceptance by draft position, target forwards and tokens.

    >>> result = SpeculativeAcceptance().compute(drafted=[3, 3, 2], accepted=[3, 1, 0])
    >>> round(result["tau"], 2), result["acceptance_by_depth"]
    (2.33, [0.6666666666666666, 0.5, 1.0])
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("keep_in_memory", True)
        super().__init__(**kwargs)

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Mean acceptance length τ and per-position acceptance of speculative decoding rounds.",
            citation="",
            inputs_description="drafted: tokens verified in the round; accepted: how many of them were accepted.",
            features=datasets.Features({"drafted": datasets.Value("int32"), "accepted": datasets.Value("int32")}),
        )

    def _compute(self, drafted, accepted) -> dict:
        if any(a > d or a < 0 for d, a in zip(drafted, accepted)):
            raise ValueError("Each round needs 0 <= accepted <= drafted")
        stats = SpeculationStats(list(drafted), list(accepted))
        return {
            "tau": stats.tau,
            "acceptance_by_depth": stats.acceptance_by_depth(),
            "target_forwards": stats.target_forwards,
            "tokens": stats.tokens,
        }
