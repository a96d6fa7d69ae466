from .configuration_dfly import DFlyConfig
from .modeling_dfly import DFlyDrafter


__all__ = ["DFlyConfig", "DFlyDrafter"]
