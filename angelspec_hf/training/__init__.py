from .callbacks import AcceptanceCallback, measure_acceptance
from .data import PackedCollator, build_training_dataset, precompute_hidden_states
from .trainer import AngelSpecTrainer, distillation_kl

__all__ = [
    "AcceptanceCallback",
    "AngelSpecTrainer",
    "PackedCollator",
    "build_training_dataset",
    "distillation_kl",
    "measure_acceptance",
    "precompute_hidden_states",
]
