"""A SmolLM2 verify forward per token count after a 128-token prefill, with the tuned plan (issue 35; not part of
the package). NO_PACKED=1 tunes without the MKL packed kernel; give each setting its own ANGELSPEC_CACHE.
WIDTHS=7,8,9,10 measures those token counts instead of the default ones."""

import os
import statistics
import time

import torch
from transformers import DynamicCache

import angelspec_hf
from angelspec_hf.generation import kernels
from angelspec_hf.generation.measurements import installed_plan


def main():
    if os.environ.get("NO_PACKED"):
        kernels.KERNELS.pop("mkl_packed", None)
    start = time.perf_counter()
    target = angelspec_hf.load_target("smollm2")
    print(f"load and tune {time.perf_counter() - start:.1f} s, {torch.get_num_threads()} threads")
    plan = installed_plan(target.model)
    print("choices", plan.choices)
    for name, seconds in plan.seconds.items():
        print(name, [round(1000 * s, 1) for s in seconds])
    prefix = torch.randint(0, 49000, (1, 128))
    with torch.no_grad():
        widths = os.environ.get("WIDTHS", "1,2,3,4,6,8,12,16")
        for width in (int(width) for width in widths.split(",")):
            times = []
            for _ in range(5):
                cache = DynamicCache()
                target.model(prefix, past_key_values=cache, use_cache=True)
                tokens = torch.randint(0, 49000, (1, width))
                began = time.perf_counter()
                target.model(tokens, past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - began)
            print(f"{width} tokens: {1000 * statistics.median(times):.1f} ms")


if __name__ == "__main__":
    main()
