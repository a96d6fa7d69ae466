"""Generation: the draft-verify loops (`generate()`'s candidate generator, the batched engine), the decoding session
and its policies. The names below are imported on first use, so that a light module here (`schedules`) imports
without torch."""

from ..lazy import lazy_exports


_EXPORTS = {
    "AngelSpecCandidateGenerator": "candidate_generator",
    "Request": "engine",
    "RequestOutput": "engine",
    "SpeculativeEngine": "engine",
    "install": "speculative",
    "speculative_generate": "speculative",
    "tune_linear_kernels": "kernels",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
