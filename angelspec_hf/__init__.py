"""angelspec_hf: AngelSpec speculative decoding as Hugging Face models.

Importing the package registers the drafters with the transformers Auto classes and routes
`target.generate(input_ids, assistant_model=drafter)` to the AngelSpec candidate generator (a batch of sequences to the
batched engine).
"""

from .generation import Request, RequestOutput, SpeculativeEngine, speculative_generate
from .generation import install as _install_generation
from .metrics import SpeculationStats
from .models import (
    AngelSpecMTPConfig,
    AngelSpecMTPDrafter,
    DFlyConfig,
    DFlyDrafter,
    RouterDrafter,
    RouterDrafterConfig,
    SuffixDrafter,
    SuffixDrafterConfig,
)
from .targets import load_target, tokenizer_fingerprint


_install_generation()

__version__ = "0.1.0"

__all__ = [
    "AngelSpecMTPConfig",
    "AngelSpecMTPDrafter",
    "DFlyConfig",
    "DFlyDrafter",
    "Request",
    "RouterDrafter",
    "RouterDrafterConfig",
    "RequestOutput",
    "SpeculationStats",
    "SpeculativeEngine",
    "SuffixDrafter",
    "SuffixDrafterConfig",
    "load_target",
    "speculative_generate",
    "tokenizer_fingerprint",
]
