from .callbacks import AcceptanceCallback, measure_acceptance
from .data import PackedCollator, build_training_dataset, precompute_hidden_states
from .trainer import AngelSpecTrainer, distillation_kl, draft_loss

__all__ = [
    "AcceptanceCallback",
    "AngelSpecTrainer",
    "PackedCollator",
    "build_training_dataset",
    "distillation_kl",
    "draft_loss",
    "measure_acceptance",
    "precompute_hidden_states",
]
