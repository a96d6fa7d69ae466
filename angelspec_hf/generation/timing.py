"""Wall-clock readings that mean what they say on an accelerator: CUDA kernels run asynchronously, so a reading taken
while the device still works on queued kernels times the launch, not the work. `ForwardClock` times a module's
forwards with hooks, for loops that do not call the target themselves (transformers' assisted-decoding loop)."""

from __future__ import annotations

import time

import torch


def device_clock(device: torch.device | str) -> float:
    """`time.perf_counter()` once `device` has finished its queued work (a CUDA device is synchronized first)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class ForwardClock:
    """Times every forward of `module` with hooks, first before and last after its other hooks (`remove()` takes
    them off): `spans` holds each forward's (start, end) readings, `take()` the seconds spent in forwards since the
    last `take()`."""

    def __init__(self, module: torch.nn.Module):
        self.device = next(module.parameters()).device
        self.spans: list[tuple[float, float]] = []
        self._start = 0.0
        self.handles = [
            module.register_forward_pre_hook(self._before, prepend=True),
            module.register_forward_hook(self._after),
        ]

    def _before(self, *args) -> None:
        self._start = device_clock(self.device)

    def _after(self, *args) -> None:
        self.spans.append((self._start, device_clock(self.device)))

    def take(self) -> float:
        seconds = sum(end - start for start, end in self.spans)
        self.spans = []
        return seconds

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
