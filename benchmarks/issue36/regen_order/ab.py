"""Regeneration throughput, one complete run: the first N MT-Bench-101 later turns, two sampled passes (seeds 1000,
5000), 48 rows, at most 160 new tokens, into a fresh file; prints generated tokens/s, and the batched-forward bound
of this dtype and row count (`angelspec regenerate`'s). Run with the code to measure first on PYTHONPATH:

    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/wt_old .venv/bin/python benchmarks/issue36/regen_order/ab.py float32 150
"""

import os
import sys
import tempfile
import time

import angelspec_hf
from angelspec_hf.generation.policies import profiled_rows
from angelspec_hf.generation.verify_cost import load_cost_model
from angelspec_hf.training.regenerate import read_responses, regenerate_responses


dtype, limit = sys.argv[1], int(sys.argv[2])
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 48
target = angelspec_hf.load_target("smollm2", dtype=dtype)
output = os.path.join(tempfile.mkdtemp(), "responses.jsonl.gz")
start = time.perf_counter()
regenerate_responses(
    target.model,
    target.tokenizer,
    ["mtbench101_later_turns"],
    output,
    data_dir="../shared/data",
    limit_per_source=limit,
    max_prompt_tokens=384,
    max_new_tokens=160,
    batch_size=batch,
    temperature=0.8,
    seed=[1000, 5000],
)
seconds = time.perf_counter() - start
records = read_responses(output)
tokens = sum(len(r["response_ids"]) for r in records)
prompt_tokens = sum(len(r["prompt_ids"]) for r in records)
bound = batch / load_cost_model(target.model, rows=profiled_rows(batch))(batch, 1)
print(
    f"code {angelspec_hf.__file__}: {dtype}, {batch} rows, {len(records)} responses, {tokens} tokens "
    f"({prompt_tokens} prompt tokens) in {seconds:.1f} s: {tokens / seconds:.1f} tokens/s; bound {bound:.1f} tokens/s"
)
