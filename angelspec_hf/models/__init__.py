"""Drafter families. Each registers with the transformers Auto classes, so `AutoModel.from_pretrained(dir)` loads it."""

import transformers
from transformers import AutoConfig, AutoModel

from .base import AngelSpecDrafterConfig, AngelSpecDrafterPreTrainedModel
from .dfly import DFlyConfig, DFlyDrafter
from .mtp import AngelSpecMTPConfig, AngelSpecMTPDrafter
from .router import RouterDrafter, RouterDrafterConfig
from .router.modeling_router import MEMBER_CLASSES
from .suffix import SuffixDrafter, SuffixDrafterConfig


DRAFTER_CLASSES = {**MEMBER_CLASSES, RouterDrafterConfig.model_type: (RouterDrafterConfig, RouterDrafter)}

for _config_class, _model_class in DRAFTER_CLASSES.values():
    AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    AutoModel.register(_config_class, _model_class, exist_ok=True)
    # Pipelines load `assistant_model="<path or id>"` by the class its config's `architectures` names in the
    # transformers namespace (pipelines.base.load_model); there the drafters' names resolve to their classes.
    setattr(transformers, _model_class.__name__, _model_class)

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
