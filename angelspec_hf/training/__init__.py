from .callbacks import AcceptanceCallback, CpuClockCallback, GracefulStopCallback, measure_acceptance
from .continuation import checkpoint_from_card, snapshot_run
from .data import PackedCollator, build_training_dataset, precompute_hidden_states, target_fingerprint
from .evaluation import AcceptanceEstimate, estimate_acceptance, estimate_on_responses
from .losses import distillation_kl, draft_loss, position_weighted_loss
from .trainer import AngelSpecTrainer, last_complete_checkpoint


__all__ = [
    "AcceptanceCallback",
    "AcceptanceEstimate",
    "AngelSpecTrainer",
    "CpuClockCallback",
    "GracefulStopCallback",
    "PackedCollator",
    "build_training_dataset",
    "checkpoint_from_card",
    "distillation_kl",
    "draft_loss",
    "estimate_acceptance",
    "estimate_on_responses",
    "last_complete_checkpoint",
    "measure_acceptance",
    "position_weighted_loss",
    "precompute_hidden_states",
    "snapshot_run",
    "target_fingerprint",
]
