"""What transformers' output_hidden_states costs a drafting round's verify forward: SmolLM2 fp32, one row, 3 new
tokens over 200 cached, without it, with the MTP drafter's taps [2, 15, 27, 30], and with every state; 40 interleaved
repeats, medians. 2026-12-07, 2-core Xeon without AMX: none 41.12 ms, taps 42.66 ms, all 42.45 ms.

    .venv/bin/python benchmarks/issue36/target_states/capture_cost.py
"""

import statistics
import time

import torch

import angelspec_hf
from angelspec_hf.cache_utils import growing_cache, with_cache


t = angelspec_hf.load_target("smollm2").model
g = torch.Generator().manual_seed(0)
prompt = torch.randint(49152, (1, 200), generator=g)
new = torch.randint(49152, (1, 3), generator=g)
pos = torch.arange(200, 203)[None]
cache = growing_cache()
times = {"none": [], "taps": [], "all": []}
opts = {"none": False, "taps": [2, 15, 27, 30], "all": True}
with torch.no_grad():
    t(input_ids=prompt, **with_cache(cache), use_cache=True)
    for rep in range(41):
        for k, o in opts.items():
            s = time.perf_counter()
            t(input_ids=new, position_ids=pos, **with_cache(cache), use_cache=True, output_hidden_states=o)
            if rep:
                times[k].append(time.perf_counter() - s)
            cache.crop(-3)
for k, v in times.items():
    print(k, f"median {statistics.median(v) * 1000:.2f} ms")
