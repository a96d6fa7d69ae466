"""What the batch cache's holes cost a decoding forward: SmolLM2 in fp32, 48 rows, one new token, over 121 cached
tokens (with and without an all-ones mask) and over 214 columns of which the first 93 are holes (masked), or all valid.
Ten repeats interleaved, the first dropped; medians. 2026-12-07, 2-core Xeon without AMX:
121 no mask 142.6 ms, 121 mask 143.3 ms, 214 with 93 holes 164.2 ms, 214 no mask 162.9 ms.

    .venv/bin/python benchmarks/issue36/regen_share/width_cost.py
"""

import statistics
import time

import torch

import angelspec_hf
from angelspec_hf.cache_utils import growing_cache, with_cache


t = angelspec_hf.load_target("smollm2").model
rows = 48
g = torch.Generator().manual_seed(0)


def setup(ctx):
    c = growing_cache()
    t(input_ids=torch.randint(49152, (rows, ctx), generator=g), **with_cache(c), use_cache=True)
    return c


new = torch.randint(49152, (rows, 1), generator=g)
cases = {}
with torch.no_grad():
    c121, c214 = setup(121), setup(214)
    valid214 = torch.zeros(rows, 215, dtype=torch.long)
    valid214[:, 214 - 121 :] = 1
    cases = {
        "121 no mask": (c121, dict(position_ids=torch.full((rows, 1), 121))),
        "121 mask": (
            c121,
            dict(position_ids=torch.full((rows, 1), 121), attention_mask=torch.ones(rows, 122, dtype=torch.long)),
        ),
        "214 mask, 93 padded": (c214, dict(position_ids=torch.full((rows, 1), 121), attention_mask=valid214)),
        "214 no mask": (c214, dict(position_ids=torch.full((rows, 1), 214))),
    }
    times = {k: [] for k in cases}
    for rep in range(10):
        for k, (c, kw) in cases.items():
            s = time.perf_counter()
            t(input_ids=new, **with_cache(c), use_cache=True, **kw)
            if rep:
                times[k].append(time.perf_counter() - s)
            c.crop(-1)
for k, v in times.items():
    print(k, f"median {statistics.median(v) * 1000:.1f} ms")
