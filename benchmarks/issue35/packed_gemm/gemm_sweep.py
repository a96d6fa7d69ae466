"""Time one sweep over SmolLM2-135M-shaped linear layers (random weights) per kernel and row count (issue 35).

Run with OMP_NUM_THREADS set as wanted; not part of the package."""

import time

import torch
import torch.nn.functional as F
import torch.utils.mkldnn


ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]


def sweep(kernel, weights, rows, repeats=3):
    """Best of `repeats` seconds of one product per weight at `rows` rows."""
    inputs = {features: torch.randn(rows, features) for features in (576, 1536)}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for weight in weights:
            kernel(inputs[weight.shape[1]], weight)
        best = min(best, time.perf_counter() - start)
    return best


def main():
    torch.manual_seed(0)
    weights = [torch.randn(out_features, in_features) * 0.02 for out_features, in_features in SHAPES]
    packed = {id(w): torch.ops.mkl._mkl_reorder_linear_weight(w, 16) for w in weights}
    transposed = {id(w): w.t().contiguous() for w in weights}
    onednn = {}
    for w in weights:
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight.data = w
        onednn[id(w)] = torch.utils.mkldnn.to_mkldnn(layer)
    kernels = {
        "F.linear": lambda x, w: F.linear(x, w),
        "x @ Wt (contiguous)": lambda x, w: torch.mm(x, transposed[id(w)]),
        "mkl packed": lambda x, w: torch.ops.mkl._mkl_linear(x, packed[id(w)], w, None, x.shape[0]),
        "oneDNN linear": lambda x, w: onednn[id(w)](x.to_mkldnn()).to_dense(),
    }
    print("rows", list(ROWS))
    for name, kernel in kernels.items():
        print(name, [round(1000 * sweep(kernel, weights, rows), 1) for rows in ROWS], flush=True)


if __name__ == "__main__":
    main()
