"""A decoding forward into transformers' DynamicCache (copies itself at every forward) against the engine's
growing_cache (writes in place): SmolLM2 fp32, 48 rows, 121 cached tokens, one new token, 11 interleaved repeats.
2026-12-07, 2-core Xeon without AMX: dynamic median 156.7 ms (115.7-165.4), growing 142.0 ms (111.1-152.6).

    .venv/bin/python benchmarks/issue36/regen_share/cache_cost.py
"""

import statistics
import time

import torch
from transformers import DynamicCache

import angelspec_hf
from angelspec_hf.cache_utils import growing_cache, with_cache


t = angelspec_hf.load_target("smollm2").model
rows, ctx = 48, 121
g = torch.Generator().manual_seed(0)
prompt = torch.randint(49152, (rows, ctx), generator=g)
new = torch.randint(49152, (rows, 1), generator=g)
pos = torch.full((rows, 1), ctx)
res = {}
with torch.no_grad():
    caches = {"dynamic": DynamicCache(), "growing": growing_cache()}
    for c in caches.values():
        t(input_ids=prompt, **with_cache(c), use_cache=True)
    times = {k: [] for k in caches}
    for rep in range(12):
        for k, c in caches.items():
            s = time.perf_counter()
            t(input_ids=new, position_ids=pos, **with_cache(c), use_cache=True)
            if rep:
                times[k].append(time.perf_counter() - s)
            c.crop(-1)
for k, v in times.items():
    print(
        k,
        f"median {statistics.median(v) * 1000:.1f} ms  min {min(v) * 1000:.1f}  max {max(v) * 1000:.1f}  -> {rows / statistics.median(v):.0f} tok/s",
    )
