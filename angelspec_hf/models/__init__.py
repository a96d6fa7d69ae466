"""Drafter families, by model type in `DRAFTER_CLASSES` (which `registration.py` registers with the transformers Auto
classes, so `AutoModel.from_pretrained(dir)` loads each)."""

from ..registration import register_drafters
from .base import AngelSpecDrafterConfig, AngelSpecDrafterPreTrainedModel
from .dfly import DFlyConfig, DFlyDrafter
from .mtp import AngelSpecMTPConfig, AngelSpecMTPDrafter
from .router import RouterDrafter, RouterDrafterConfig
from .router.modeling_router import MEMBER_CLASSES
from .suffix import SuffixDrafter, SuffixDrafterConfig


DRAFTER_CLASSES = {**MEMBER_CLASSES, RouterDrafterConfig.model_type: (RouterDrafterConfig, RouterDrafter)}
register_drafters()  # with the classes imported, at once

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
