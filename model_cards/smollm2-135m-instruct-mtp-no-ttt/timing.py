"""Wall-clock readings that mean what they say on an accelerator: CUDA kernels run asynchronously, so a reading taken
while the device still works on queued kernels times the launch, not the work."""

from __future__ import annotations

import time

import torch


def device_clock(device: torch.device | str) -> float:
    """`time.perf_counter()` once `device` has finished its queued work (a CUDA device is synchronized first)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
