from .configuration_mtp import AngelSpecMTPConfig
from .modeling_mtp import AngelSpecMTPDrafter


__all__ = ["AngelSpecMTPConfig", "AngelSpecMTPDrafter"]
