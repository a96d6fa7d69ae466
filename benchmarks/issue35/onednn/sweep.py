"""Does oneDNN's linear with a prepacked weight (the kernel torch.compile's CPU backend uses) take 4-8 rows of
SmolLM2-135M's products for less than MKL's packed GEMM, which steps up at four rows on the Xeon (AMX)?
One sweep over every linear layer of the target per kernel and row count, interleaved, median of 9.

    .venv/bin/python benchmarks/issue35/onednn/sweep.py [--max-rows 10]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import angelspec_hf
from angelspec_hf.generation.kernels import _linear_layers, _packed


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-rows", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    model = angelspec_hf.load_target("smollm2", tune_kernels=False).model
    layers = _linear_layers(model)
    onednn = {id(layer): torch.ops.mkldnn._reorder_linear_weight(layer.weight, 4) for layer in layers}
    kernels = {
        "x_wt": lambda x, layer: F.linear(x, layer.weight),
        "mkl_packed": lambda x, layer: _packed(x, layer.weight),
        "onednn": lambda x, layer: torch.ops.mkldnn._linear_pointwise(x, onednn[id(layer)], None, "none", [], ""),
        "onednn_dense": lambda x, layer: torch.ops.mkldnn._linear_pointwise(x, layer.weight, None, "none", [], ""),
    }
    generator = torch.Generator().manual_seed(0)
    inputs = {
        rows: {f: torch.randn(rows, f, generator=generator) for f in {layer.in_features for layer in layers}}
        for rows in range(1, args.max_rows + 1)
    }
    for rows, row_inputs in inputs.items():  # outputs agree
        x = row_inputs[layers[0].in_features]
        reference = F.linear(x, layers[0].weight)
        for name, kernel in kernels.items():
            assert torch.allclose(kernel(x, layers[0]), reference, atol=1e-4), name
    timings = {(name, rows): [] for name in kernels for rows in inputs}
    for repeat in range(args.repeats + 1):
        for rows, row_inputs in inputs.items():
            for name, kernel in kernels.items():
                start = time.perf_counter()
                for layer in layers:
                    kernel(row_inputs[layer.in_features], layer)
                if repeat:
                    timings[name, rows].append(time.perf_counter() - start)
    print(f"threads {torch.get_num_threads()}; ms per sweep over {len(layers)} linear layers (median)")
    print("rows " + "".join(f"{name:>12s}" for name in kernels))
    for rows in inputs:
        print(f"{rows:4d} " + "".join(f"{1000 * statistics.median(timings[name, rows]):12.1f}" for name in kernels))


if __name__ == "__main__":
    main()
