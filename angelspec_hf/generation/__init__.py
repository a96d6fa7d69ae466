from .candidate_generator import AngelSpecCandidateGenerator
from .speculative import install, speculative_generate

__all__ = ["AngelSpecCandidateGenerator", "install", "speculative_generate"]
