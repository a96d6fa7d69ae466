from .configuration_suffix import SuffixDrafterConfig
from .modeling_suffix import SuffixDrafter, SuffixIndex


__all__ = ["SuffixDrafter", "SuffixDrafterConfig", "SuffixIndex"]
