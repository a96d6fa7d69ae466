"""Generation: the draft-verify loops (`generate()`'s candidate generator, the batched engine), the decoding session
and its policies. The names below are imported on first use, so that a light module here (`schedules`) imports
without torch."""

import importlib


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


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
