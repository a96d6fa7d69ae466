"""bf16 where this machine computes it faster (issue 36, item 3).

Three computations dominate making a drafter on a CPU: the target's prefill that computes the cached training states,
a draft layer's training step, and the target's batched decoding that regenerates responses. Whether bf16 speeds
them up depends on the CPU, not on whether it lists bf16 instructions: with AMX tiles (2-core Xeon, 2026-12-07) 2.8×,
1.8× and 1.68× (regeneration's tokens/s); with AVX-512 BF16 but no AMX (another 2-core Xeon) 0.61×, 0.64× and 0.83×
— slower (`benchmarks/issue36/bf16_speed*.json`). So each is measured on the machine, on the computation itself at
the run's shapes, and bf16 is used only where it is at least `MIN_SPEEDUP` faster.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from ..generation.timing import device_clock


MIN_SPEEDUP = 1.1
"""bf16 is chosen only where it is at least this much faster: it costs a little fidelity (the target's bf16 states
agree with its float32 ones to a drafter's τ within 0.01 on a small rung, docs/experiments.md), and a ratio nearer 1
is within a shared machine's noise."""


def median_seconds(step: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The median seconds of `step()` over `repeats` calls after one warm-up call (allocations, kernel choice)."""
    step()
    times = []
    for _ in range(repeats):
        start = device_clock(device)
        step()
        times.append(device_clock(device) - start)
    return statistics.median(times)


def autocast_seconds(step: Callable[[], object], device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """The median seconds of `step()` in float32 and under bf16 autocast."""
    fp32 = median_seconds(step, device, repeats)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        bf16 = median_seconds(step, device, repeats)
    return fp32, bf16


def _random_rows(target, rows: int, length: int) -> torch.Tensor:
    vocab = target.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0)).to(target.device)


def prefill_seconds(target, rows: int = 4, length: int = 256, repeats: int = 3) -> tuple[float, float]:
    """`autocast_seconds` of the target's prefill that computes training states (every hidden state, no
    cache), `rows` rows of `length` tokens."""
    ids = _random_rows(target, rows, length)

    @torch.no_grad()
    def prefill():
        target.get_decoder()(input_ids=ids, use_cache=False, output_hidden_states=True)

    return autocast_seconds(prefill, target.device, repeats)


def draft_step_seconds(target, rows: int = 4, length: int = 256, repeats: int = 3) -> tuple[float, float]:
    """`autocast_seconds` of a training step (forward, backward, AdamW) of one decoder layer of the target's
    family and width, what a drafter trains, over `rows` rows of `length` states."""
    decoder = target.get_decoder()
    config = target.config.get_text_config()
    layer = type(decoder.layers[0])(config, layer_idx=0).float().to(target.device)
    states = torch.randn(rows, length, config.hidden_size, device=target.device)
    positions = torch.arange(length, device=target.device).expand(rows, -1)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-5)

    def step():
        hidden = states.clone().requires_grad_()
        out = layer(hidden, position_embeddings=decoder.rotary_emb(hidden, positions), position_ids=positions)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return autocast_seconds(step, target.device, repeats)


def decode_seconds(fp32_target, bf16_target, rows: int, context: int = 128, repeats: int = 3) -> tuple[float, float]:
    """The seconds of a decoding step of the target loaded in float32 and loaded in bfloat16: one new token for each
    of `rows` rows over a `context`-token cache (`profile_verify_cost`)."""
    from ..generation.verify_cost import profile_verify_cost

    fp32, bf16 = (
        profile_verify_cost(target, rows=[rows], tokens=[1], context=context, repeats=repeats, progress=False)(rows, 1)
        for target in (fp32_target, bf16_target)
    )
    return fp32, bf16


@dataclass(frozen=True)
class Bf16Choice:
    """Where a training run computes in bf16, each part by its measured speedup (fp32 seconds over bf16 seconds):
    the target's prefill of the cached training states, and the drafter's training step (the Trainer's `bf16`)."""

    states_speedup: float
    step_speedup: float

    @classmethod
    def measure(cls, target, rows: int = 4, length: int = 256, repeats: int = 3) -> "Bf16Choice":
        prefill, step = (
            prefill_seconds(target, rows, length, repeats),
            draft_step_seconds(target, rows, length, repeats),
        )
        return cls(states_speedup=prefill[0] / prefill[1], step_speedup=step[0] / step[1])

    @property
    def states(self) -> bool:
        return self.states_speedup >= MIN_SPEEDUP

    @property
    def step(self) -> bool:
        return self.step_speedup >= MIN_SPEEDUP

    @property
    def states_dtype(self) -> str:
        """`hidden_compute_dtype` (`training.data.COMPUTE_DTYPES`) of the cached training states."""
        return "bfloat16" if self.states else "float32"

    def arguments(self) -> list[str]:
        """The choice as `examples/train_drafter.py` arguments (`DataArguments`, `TrainingArguments`)."""
        return ["--hidden_compute_dtype", self.states_dtype, "--bf16", str(self.step).lower()]

    def describe(self) -> str:
        return (
            f"bf16 autocast measured {self.states_speedup:.2f}x on the target's prefill and {self.step_speedup:.2f}x "
            f"on a draft layer's training step: training states in {self.states_dtype}, training step in "
            f"{'bfloat16' if self.step else 'float32'} (bf16 where at least {MIN_SPEEDUP}x faster)"
        )
