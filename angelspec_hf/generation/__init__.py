from .candidate_generator import AngelSpecCandidateGenerator
from .engine import Request, RequestOutput, SpeculativeEngine
from .kernels import tune_linear_kernels
from .speculative import install, speculative_generate


__all__ = [
    "AngelSpecCandidateGenerator",
    "Request",
    "RequestOutput",
    "SpeculativeEngine",
    "install",
    "speculative_generate",
    "tune_linear_kernels",
]
