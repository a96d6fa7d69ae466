"""Drafter families, by model type in `DRAFTER_CLASSES`.

Importing this package registers each family with transformers' Auto classes (its public `register` calls), so
`AutoModel.from_pretrained(dir)` loads a drafter folder, and routes `target.generate(assistant_model=drafter)` to
AngelSpec's draft-verify loop (`generation.speculative.install`): both once, here, where every drafter class comes
from (`import angelspec_hf` imports it on the first lookup of a drafter name or model type, `registration.py`).
"""

import sys

import transformers.processing_utils  # noqa: F401  (see `_register`)
from transformers import AutoConfig, AutoModel

from ..generation.speculative import install
from .base import AngelSpecDrafterConfig, AngelSpecDrafterPreTrainedModel
from .dfly import DFlyConfig, DFlyDrafter
from .mtp import AngelSpecMTPConfig, AngelSpecMTPDrafter
from .router import RouterDrafter, RouterDrafterConfig
from .router.modeling_router import MEMBER_CLASSES
from .suffix import SuffixDrafter, SuffixDrafterConfig


DRAFTER_CLASSES = {**MEMBER_CLASSES, RouterDrafterConfig.model_type: (RouterDrafterConfig, RouterDrafter)}


def _register() -> None:
    """Each family with `AutoConfig` / `AutoModel`, and by name in the `transformers` namespace, where
    `pipeline(..., assistant_model="<path or id>")` resolves a checkpoint's `architectures`. (The first import of
    `transformers.processing_utils`, above, re-runs transformers/__init__.py and puts a new module object in
    sys.modules["transformers"]: done before the names are set, so that they stay.)"""
    for config_class, model_class in DRAFTER_CLASSES.values():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, model_class, exist_ok=True)
        setattr(sys.modules["transformers"], model_class.__name__, model_class)


_register()
install()

__all__ = [
    "AngelSpecDrafterConfig",
    "AngelSpecDrafterPreTrainedModel",
    "AngelSpecMTPConfig",
    "AngelSpecMTPDrafter",
    "DFlyConfig",
    "DFlyDrafter",
    "DRAFTER_CLASSES",
    "RouterDrafter",
    "RouterDrafterConfig",
    "SuffixDrafter",
    "SuffixDrafterConfig",
]
