from .callbacks import AcceptanceCallback, measure_acceptance
from .data import PackedCollator, build_training_dataset, precompute_hidden_states, target_fingerprint
from .trainer import AngelSpecTrainer, distillation_kl, draft_loss, last_complete_checkpoint

__all__ = [
    "AcceptanceCallback",
    "AngelSpecTrainer",
    "PackedCollator",
    "build_training_dataset",
    "distillation_kl",
    "draft_loss",
    "last_complete_checkpoint",
    "measure_acceptance",
    "precompute_hidden_states",
    "target_fingerprint",
]
