"""angelspec_hf: AngelSpec speculative decoding as Hugging Face models.

Importing the package registers the drafters with the transformers Auto classes (`registration.py`: before
transformers first looks a model type up); importing the drafter classes routes
`target.generate(input_ids, assistant_model=drafter)` to the AngelSpec candidate generator (a batch of sequences to
the batched engine). `load_drafter(name)` finds the shipped drafters by name. The names below are imported on first
use, as transformers' own are, so that `import angelspec_hf` (and `angelspec --help`) does not import torch.
"""

from .lazy import lazy_exports
from .registration import register_on_first_lookup


__version__ = "0.1.0"

_EXPORTS = {
    "AngelSpecMTPConfig": "models",
    "AngelSpecMTPDrafter": "models",
    "DFlyConfig": "models",
    "DFlyDrafter": "models",
    "Request": "generation",
    "RequestOutput": "generation",
    "RouterDrafter": "models",
    "RouterDrafterConfig": "models",
    "SpeculationStats": "metrics",
    "SpeculativeEngine": "generation",
    "SuffixDrafter": "models",
    "SuffixDrafterConfig": "models",
    "load_drafter": "hub",
    "load_target": "targets",
    "shipped_drafter_path": "hub",
    "speculative_generate": "generation",
    "tokenizer_fingerprint": "targets",
    "tune_linear_kernels": "generation",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


register_on_first_lookup()
