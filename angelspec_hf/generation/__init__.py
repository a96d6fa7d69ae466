from .candidate_generator import AngelSpecCandidateGenerator
from .engine import Request, RequestOutput, SpeculativeEngine
from .speculative import install, speculative_generate


__all__ = [
    "AngelSpecCandidateGenerator",
    "Request",
    "RequestOutput",
    "SpeculativeEngine",
    "install",
    "speculative_generate",
]
