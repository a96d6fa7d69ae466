from .configuration_router import RouterDrafterConfig
from .modeling_router import RouterDrafter


__all__ = ["RouterDrafter", "RouterDrafterConfig"]
