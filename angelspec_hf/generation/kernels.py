"""Linear layers that run, for each row count, the matrix product this machine does fastest at that count.

A verify forward of 1 + n tokens reads every weight of the target once, so on a CPU its cost should barely grow
with n until the product turns compute-bound: that flat stretch is what speculative decoding spends. Not every BLAS
delivers it. On this project's machine (AMD EPYC, PyTorch's MKL build) `F.linear`, y = x Wᵀ, costs per forward of
SmolLM2-135M about 51 ms of products for one row, 63 for two and 79 for three, while the same products taken as
(W xᵀ)ᵀ cost 17 ms for two rows and 26 for four: a different GEMM shape that streams each weight once.
On the Intel Xeon (AMX) machine both orientations step up at four rows instead (a sweep over SmolLM2-135M's
products, 2 threads: 23 ms for three rows, 34 for four, 42 for eight), while MKL's packed GEMM (`cblas_sgemm_pack`
once per weight, then `cblas_sgemm_compute`, PyTorch's `mkl::_mkl_linear`) costs 27 for four and 33 for eight: the
weight laid out once for the small-M kernel. `tune_linear_kernels(model)` times each kernel over all of a model's
linear layers at every row count up to `max_rows` (a sweep over every layer, so the weights come from memory as in a
forward), lets a row count borrow a larger one's kernel by padding with zero rows where that is faster, and makes
each `nn.Linear` follow the plan. A plan that uses the packed kernel keeps a packed copy of each weight beside it
(the linear weights twice in memory: about 0.5 GB more for SmolLM2-135M in float32).
The plan is cached per machine beside the verify-cost profile, whose key names the plan (D-cut's profile is of the
tuned model). Outputs equal `F.linear`'s up to float rounding (another summation order), like any change of batch
shape; autograd and row counts beyond `max_rows` take `F.linear` unchanged.
Written by hand: no library chooses a GEMM kernel by row count.
"""

from __future__ import annotations

import hashlib
import json
import time
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .measurements import cache_path, machine_description, read_or_measure, write_json_atomically


def _weight_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x Wᵀ (PyTorch's own `F.linear`)."""
    return F.linear(x, weight)


def _weight_columns(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = (W xᵀ)ᵀ: the same product as a tall-skinny GEMM over W's rows."""
    return torch.mm(weight, x.t()).t()


MAX_ROWS = 16  # row counts tuned: a verify of up to 16 tokens, or that many single-token rows
# Each float32 weight's MKL-packed copy, by the weight's id: (a weak reference to the weight, its version and storage
# when packed, the packed copy). Kept here rather than on the parameter, so that pickling or copying a model never
# meets an opaque packed tensor; the reference's callback drops the entry with its weight.
_PACKED: dict[int, tuple[weakref.ref, tuple[int, int], torch.Tensor]] = {}


def _mkl_packing_available() -> bool:
    """Whether this PyTorch build has MKL's packed GEMM (x86 builds with MKL)."""
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def _packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """`weight` packed for MKL's small-M GEMM (`cblas_sgemm_pack`), made on first use and again after the weight
    changed (an in-place update, `load_state_dict`, new storage)."""
    key, stamp = id(weight), (weight._version, weight.data_ptr())
    entry = _PACKED.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != stamp:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), MAX_ROWS)
        entry = _PACKED[key] = (weakref.ref(weight, lambda _, key=key: _PACKED.pop(key, None)), stamp, packed)
    return entry[2]


def _packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ (+ b) by MKL's packed GEMM over W's packed copy, x of any leading shape (`F.linear` for what it does
    not take: other than float32 on the CPU)."""
    if weight.dtype != torch.float32 or x.dtype != torch.float32 or weight.device.type != "cpu":
        return F.linear(x, weight, bias)
    return torch.ops.mkl._mkl_linear(x, _packed_copy(weight), weight, bias, x.numel() // x.shape[-1])


def forget_packed_copies(weights) -> None:
    """Drop the packed copies of these weights (a plan that does not use them)."""
    for weight in weights:
        _PACKED.pop(id(weight), None)


PACKED = "mkl_packed"
KERNELS = {"x_wt": _weight_rows, "w_xt": _weight_columns}
if _mkl_packing_available():
    KERNELS[PACKED] = _packed
DEFAULT_KERNEL = "x_wt"
MARGIN = 0.05  # a kernel replaces the default only when a sweep with it is at least this much faster


@dataclass
class LinearKernelPlan:
    """Per row count, the kernel (a `KERNELS` name) and the row count it runs at (padded with zero rows); the
    seconds of one sweep over the model's linear layers per kernel and row count (1 … `max_rows`) it was chosen
    from; and the machine (`machine_description`) it was measured on."""

    max_rows: int
    seconds: dict[str, list[float]]
    machine: dict
    choices: dict[int, tuple[str, int]]

    @classmethod
    def from_seconds(cls, seconds: dict[str, list[float]], machine: dict) -> "LinearKernelPlan":
        """Each row count takes the fastest (kernel, rows ≥ it) of the sweep, unless that is within `MARGIN` of the
        default kernel at its own rows; only row counts that leave the default are kept."""
        max_rows = len(seconds[DEFAULT_KERNEL])
        choices = {}
        for rows in range(1, max_rows + 1):
            options = [
                (seconds[name][padded - 1], name, padded) for name in seconds for padded in range(rows, max_rows + 1)
            ]
            best, name, padded = min(options)
            if best < (1 - MARGIN) * seconds[DEFAULT_KERNEL][rows - 1]:
                choices[rows] = (name, padded)
        return cls(max_rows, seconds, machine, choices)

    def fingerprint(self) -> str:
        """A short hash of the choices (what a forward's cost depends on)."""
        text = json.dumps(sorted(self.choices.items()))
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def save(self, path: str) -> None:
        """Write atomically (`write_json_atomically`), as the verify-cost profile is written."""
        write_json_atomically(path, {**asdict(self), "choices": sorted(self.choices.items())})

    @classmethod
    def load(cls, path: str) -> "LinearKernelPlan":
        with open(path) as file:
            data = json.load(file)
        choices = {int(rows): (str(name), int(padded)) for rows, (name, padded) in data["choices"]}
        for rows, (name, padded) in choices.items():
            if name not in KERNELS or not rows <= padded <= int(data["max_rows"]):
                raise ValueError(f"invalid choice for {rows} rows: {name!r} at {padded} rows")
        return cls(int(data["max_rows"]), data["seconds"], data["machine"], choices)


class TunedLinear(nn.Linear):
    """An `nn.Linear` whose inference forward runs its plan's kernel for its input's row count (module docstring).
    `tune_linear_kernels` turns a model's `nn.Linear` modules into these in place (parameters untouched)."""

    kernel_plan: LinearKernelPlan

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.numel() // self.in_features if self.in_features else 0
        choice = self.kernel_plan.choices.get(rows)
        if choice is None or (torch.is_grad_enabled() and (input.requires_grad or self.weight.requires_grad)):
            return super().forward(input)
        name, padded = choice
        if name == PACKED and padded == rows:  # takes the input as it is, and the bias: no reshapes or copies
            return _packed(input, self.weight, self.bias)
        flat = input.reshape(rows, self.in_features)
        if padded > rows:
            flat = F.pad(flat, (0, 0, 0, padded - rows))
        output = KERNELS[name](flat, self.weight)[:rows].contiguous()
        if self.bias is not None:
            output = output + self.bias
        return output.reshape(*input.shape[:-1], self.out_features)


def _linear_layers(model: nn.Module) -> list[nn.Linear]:
    return [module for module in model.modules() if type(module) in (nn.Linear, TunedLinear)]


def untune_linear_kernels(model: nn.Module) -> None:
    """Back to plain `nn.Linear` everywhere (packed copies dropped)."""
    for module in _linear_layers(model):
        if isinstance(module, TunedLinear):
            module.__class__ = nn.Linear
            del module.kernel_plan
            forget_packed_copies([module.weight])


@torch.no_grad()
def measure_linear_kernels(model: nn.Module, max_rows: int = MAX_ROWS, repeats: int = 7) -> LinearKernelPlan:
    """Time one sweep over all of `model`'s linear layers with each kernel at each row count 1 … `max_rows`
    (median of `repeats`, after one warm-up round; every kernel and row count takes its turn within each round, so
    a burst of load on a shared machine lands on one repeat of each) and choose the plan
    (`LinearKernelPlan.from_seconds`)."""
    if not isinstance(max_rows, int) or max_rows < 1 or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"max_rows and repeats must be positive integers, got {max_rows!r} and {repeats!r}")
    layers = _linear_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to tune")
    weight = layers[0].weight
    generator = torch.Generator().manual_seed(0)
    inputs = [
        {
            features: torch.randn(rows, features, generator=generator).to(weight.device, weight.dtype)
            for features in {layer.in_features for layer in layers}
        }
        for rows in range(1, max_rows + 1)
    ]
    timings = {name: [[] for _ in inputs] for name in KERNELS}
    for repeat in range(repeats + 1):
        for index, row_inputs in enumerate(inputs):
            for name, kernel in KERNELS.items():
                start = time.perf_counter()
                for layer in layers:
                    kernel(row_inputs[layer.in_features], layer.weight)
                if repeat:
                    timings[name][index].append(time.perf_counter() - start)
    seconds = {name: [sorted(times)[len(times) // 2] for times in lines] for name, lines in timings.items()}
    plan = LinearKernelPlan.from_seconds(seconds, machine_description(model))
    if PACKED not in {name for name, _ in plan.choices.values()}:
        forget_packed_copies(layer.weight for layer in layers)
    return plan


def kernel_plan_path(model: nn.Module) -> str:
    """Where the plan of `model` on this machine is cached (beside the verify-cost profile)."""
    return cache_path("linear_kernels", model)


def tune_linear_kernels(
    model: nn.Module, path: str | None = None, measure: bool = False, max_rows: int = MAX_ROWS
) -> LinearKernelPlan | None:
    """Make `model`'s linear layers follow this machine's plan: the cached one, or one measured now (about ten
    seconds for a 135M model; cached) when none is cached, it is unreadable, or `measure` asks for a new one.
    CPU models only (GPU BLAS libraries choose their kernels by shape themselves): elsewhere nothing changes and
    None is returned."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return None
    untune_linear_kernels(model)  # the plan's key and measurement are of the plain model
    path = path or kernel_plan_path(model)
    plan = read_or_measure(
        path,
        LinearKernelPlan.load,
        "linear-kernel plan",
        lambda cached: measure_linear_kernels(model, max_rows=max_rows),
        # a plan timed without one of this build's kernels (an older package's) is measured again
        usable=lambda plan: plan.max_rows == max_rows and set(plan.seconds) == set(KERNELS),
        fresh=measure,
    )
    follow_plan(model, plan)
    return plan


def follow_plan(model: nn.Module, plan: LinearKernelPlan) -> None:
    """Make `model`'s linear layers follow `plan` (a drafter bound to a tuned target follows the target's: the same
    BLAS behaves the same on the drafter's layers)."""
    for module in _linear_layers(model):
        module.__class__ = TunedLinear
        module.kernel_plan = plan
